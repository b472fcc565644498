//! The shared core: what every room of the daemon uses and none of them owns. The node's
//! handle ([`Node`]: identity, configuration, model shape, network client, what it serves,
//! counters, who is proven to lie), its configuration (`config.rs`), the peer table and the
//! route and shard arithmetic over it (`view.rs`), memory sizes (`memory.rs`) and activations
//! on the wire (`wire.rs`). Nothing here imports the stage, the checks, the head or the API.

pub mod config;
pub mod memory;
pub mod node;
pub mod view;
pub mod wire;

pub use config::{LayerChoice, NodeConfig, SpotRate};
pub use node::{Node, NodeParts, Serving, Stats, MAX_ANNOUNCEMENT, UNUSABLE_FOR};
