//! The stage: the layers this daemon serves for every head that routes through it. It runs
//! hops on its KV caches, several generations' together when they arrive together
//! (`queue.rs`), and signs a record of each (`hop.rs`), keeps the last hops and the
//! cache rows so a head can check them (`reveal.rs`), and replays other stages' hops when a
//! head audits them (`replay.rs`). Its state is one [`Stage`] (`server.rs`); how a hop is
//! computed is its [`HopRunner`] (`runner.rs`), honest unless a test build was told to lie
//! (`fault.rs`).
//!
//! The stage never checks anyone: it answers. What it signs is all a head or a referee needs to
//! hold it to its word.

mod caches;
#[cfg(feature = "fault-injection")]
pub mod fault;
mod hop;
mod queue;
mod replay;
mod reveal;
mod runner;
mod server;

pub use caches::{StageCaches, KEPT_BYTES, KEPT_HOPS};
pub use queue::{MAX_HOP_ROWS, MAX_STACK};
pub use runner::{Honest, HopResult, HopRunner, QueuedHop};
pub use server::Stage;
