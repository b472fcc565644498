//! What a head keeps of one route stage's hops in one generation: the inputs it sent, the
//! records the stage signed and their traces. Every check and audit of the stage, and any
//! proof against it, is built from this log.

use std::sync::Arc;

use dc_model::Activations;
use dc_types::{HopRecord, HopTrace, Signed};

/// Everything the head kept about one route stage in one generation. The inputs and traces
/// are shared, not copied, when the log is cloned: every hop's spot check and audit takes the
/// log so far, and copying it whole would make a generation's checks quadratic in its length.
#[derive(Clone, Debug, Default)]
pub struct StageLog {
    /// Inputs of each hop, in order.
    pub inputs: Vec<Arc<Activations>>,
    /// The signed records.
    pub records: Vec<Signed<HopRecord>>,
    /// Their traces.
    pub traces: Vec<Arc<HopTrace>>,
}
