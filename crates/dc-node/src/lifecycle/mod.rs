//! The daemon's life: start-up and graceful exit (`start.rs`), the network's events sent to
//! the room that owns each (`events.rs`), what it says and hears on the gossip topic
//! (`gossip.rs`), and which layers it serves and keeps serving (`shards.rs`).

mod events;
mod gossip;
mod shards;
mod start;

pub use start::run;
