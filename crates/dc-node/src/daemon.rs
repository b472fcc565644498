//! The daemon's rooms side by side: the shared core ([`Node`]), the stage it serves
//! ([`Stage`]), the model's files it shares ([`Weights`]) and the checks it runs ([`Checks`]).
//! The head and the API work across rooms and take this; cloning it is four `Arc`s.

use std::sync::Arc;

use crate::check::Checks;
use crate::core::Node;
use crate::stage::{HopRunner, Stage};
use crate::weights::Weights;

/// A running daemon's rooms.
#[derive(Clone, Debug)]
pub struct Daemon {
    /// The shared core.
    pub node: Arc<Node>,
    /// The stage this daemon serves.
    pub stage: Arc<Stage>,
    /// The model's files, served to peers (and fetched from them).
    pub weights: Arc<Weights>,
    /// The checks it runs.
    pub checks: Arc<Checks>,
}

impl Daemon {
    /// The rooms of `node`, its hops computed by `runner`, its files `weights`.
    pub fn new(node: Arc<Node>, runner: Arc<dyn HopRunner>, weights: Weights) -> Daemon {
        let stage = Arc::new(Stage::new(node.clone(), runner));
        let weights = Arc::new(weights);
        let checks = Arc::new(Checks::new(node.clone(), stage.clone(), weights.clone()));
        Daemon {
            node,
            stage,
            weights,
            checks,
        }
    }
}
