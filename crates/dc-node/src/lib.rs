//! The DaisyChain daemon: loads the layers it serves, joins the swarm, announces itself, serves
//! hops for other heads, heads generations it is elected for, and answers the local control
//! API. Heavy maths runs on the compute pool through `spawn_blocking`, never on the async
//! tasks that move messages.

#![deny(missing_docs)]

pub mod api;
pub mod audit;
pub mod config;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod head;
pub mod idle;
pub mod memory;
pub mod metrics;
pub mod node;
pub mod openai;
pub mod stage;
pub mod status;
pub mod verify;
pub mod view;

pub use config::{LayerChoice, NodeConfig};
pub use node::{run, Node};
