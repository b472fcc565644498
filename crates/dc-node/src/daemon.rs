//! The daemon's rooms side by side: the shared core ([`Node`]), the stage it serves
//! ([`Stage`]) and the checks it runs ([`Checks`]). The head and the API work across rooms and
//! take this; cloning it is three `Arc`s.

use std::sync::Arc;

use crate::check::Checks;
use crate::core::Node;
use crate::stage::{HopRunner, Stage};

/// A running daemon's rooms.
#[derive(Clone, Debug)]
pub struct Daemon {
    /// The shared core.
    pub node: Arc<Node>,
    /// The stage this daemon serves.
    pub stage: Arc<Stage>,
    /// The checks it runs.
    pub checks: Arc<Checks>,
}

impl Daemon {
    /// The rooms of `node`, its hops computed by `runner`.
    pub fn new(node: Arc<Node>, runner: Arc<dyn HopRunner>) -> Daemon {
        let stage = Arc::new(Stage::new(node.clone(), runner));
        let checks = Arc::new(Checks::new(node.clone(), stage.clone()));
        Daemon {
            node,
            stage,
            checks,
        }
    }
}
