//! The DaisyChain daemon: loads the layers it serves, joins the swarm, announces itself, serves
//! hops for other heads, heads generations it is elected for, and answers the local control
//! API. Heavy maths runs on the compute pool through `spawn_blocking`, never on the async
//! tasks that move messages.

#![deny(missing_docs)]

pub mod api;
pub mod audit;
pub mod claims;
pub mod config;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod head;
pub mod idle;
pub mod memory;
pub mod metrics;
pub mod node;
pub mod openai;
pub mod relay;
pub mod spot;
pub mod stage;
pub mod status;
pub mod verify;
pub mod view;

pub use config::{LayerChoice, NodeConfig, SpotRate};
pub use node::{run, Node};

/// Whether this build can lie on request (the `fault-injection` feature, for tests only).
pub const FAULT_INJECTION: bool = cfg!(feature = "fault-injection");

/// Makes this daemon lie as `spec` (`KIND[:FRACTION]`) says; an error naming the problem for a
/// bad spec, and always in builds without the `fault-injection` feature.
pub fn inject_fault(spec: &str) -> Result<(), String> {
    #[cfg(feature = "fault-injection")]
    {
        let f: fault::Fault = spec.parse()?;
        if fault::set(f) {
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
