//! Idle-only mode: pause new work while other processes keep the CPU busy (to be written).

use std::sync::Arc;

use crate::node::Node;

/// Starts watching the machine's load for `node`.
pub fn spawn(node: Arc<Node>) {
    let _ = node;
}
