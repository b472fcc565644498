//! The DaisyChain daemon: loads the layers it serves, joins the swarm, announces itself, serves
//! hops for other heads, heads generations it is elected for, checks the peers it routes
//! through, and answers the local control API. Heavy maths runs on the compute pool through
//! `spawn_blocking`, never on the async tasks that move messages.
//!
//! The rooms, from the ground up (each imports only those below it):
//! - [`core`]: the node's handle, configuration and peer view, shared by all;
//! - [`stage`]: serving hops, caches and reveals for other heads;
//! - [`weights`]: the model's files shared with peers, and fetched from them;
//! - [`check`]: audits, spot checks, referees, proofs, claims and exclusion;
//! - [`daemon`]: the rooms side by side;
//! - [`head`]: one generation's driver, and electing and reaching a generation's head;
//! - [`api`]: the control and OpenAI-compatible HTTP APIs, status and metrics;
//! - [`lifecycle`]: start-up, the network's events, gossip, shards, and the exit.

#![deny(missing_docs)]

pub mod api;
pub mod check;
pub mod core;
pub mod daemon;
pub mod head;
pub mod idle;
pub mod lifecycle;
pub mod stage;
pub mod weights;

pub use crate::core::{LayerChoice, Node, NodeConfig, SpotRate};
pub use daemon::Daemon;
pub use lifecycle::run;

/// Whether this build can lie on request (the `fault-injection` feature, for tests only).
pub const FAULT_INJECTION: bool = cfg!(feature = "fault-injection");

/// Makes this daemon lie as `spec` (`KIND[:FRACTION]`) says; an error naming the problem for a
/// bad spec, and always in builds without the `fault-injection` feature.
pub fn inject_fault(spec: &str) -> Result<(), String> {
    #[cfg(feature = "fault-injection")]
    {
        let f: stage::fault::Fault = spec.parse()?;
        if stage::fault::set(f) {
            Ok(())
        } else {
            Err("a fault is already configured".into())
        }
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        Err(format!(
            "--fault {spec}: this dcd was built without the fault-injection feature"
        ))
    }
}
