//! The head: one generation's driver. The requester elects the head and relays its events
//! (`remote.rs`, bounded by `bounds.rs`); the head plans a route (`plan.rs`), runs laps through
//! the stages (`attempt.rs`), checks every hop's answer (`hop.rs`), samples and streams
//! (`driver.rs`), and goes round again without a peer proven to lie or unusable (`stop.rs`).
//! It uses the checks room to audit and spot-check, and the stage room for its own layers.

mod attempt;
pub mod bounds;
mod driver;
mod hop;
mod plan;
mod remote;
mod stop;

pub use driver::{run_as_head, EVENT_QUEUE};
pub use plan::sampling;
pub use remote::{serve_generation_stream, start_generation};
