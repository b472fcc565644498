//! How this daemon computes and presents a hop: the one seam where a test daemon's lies are
//! plugged in. The stage calls a [`HopRunner`] chosen once at start; the honest one runs the
//! layers and changes nothing, and the test-only fault decorator (`fault.rs`, built with the
//! `fault-injection` feature) wraps the same calls to lie. The honest path has no branch for
//! faults.

use dc_kernels::{Commitment, Gemm};
use dc_model::{Activations, KeptHop, KvCache, Model};
use dc_types::{GenerationId, HopTrace};

/// Which hop: its generation and step.
#[derive(Clone, Copy, Debug)]
pub struct HopId {
    /// The generation.
    pub generation: GenerationId,
    /// The step (0 for the first hop of a generation).
    pub step: u64,
}

/// Runs a stage's hops and says what it signs and sends for them.
pub trait HopRunner: Send + Sync + std::fmt::Debug {
    /// Runs `model`'s layers over `x` on `cache`, filling `trace`; returns the output and what
    /// is kept to reveal rows of the hop later.
    fn run(
        &self,
        model: &Model,
        gemm: &Gemm,
        x: Activations,
        cache: &mut KvCache,
        trace: &mut HopTrace,
        hop: HopId,
    ) -> dc_model::Result<(Activations, KeptHop)>;

    /// The chain of inputs the record of `hop` names (honestly: `previous`).
    fn previous(&self, previous: Commitment, _hop: HopId) -> Commitment {
        previous
    }

    /// The trace sent with the record of `hop` (honestly: the signed one).
    fn sent_trace(&self, trace: HopTrace, _hop: HopId) -> HopTrace {
        trace
    }

    /// Whether the stage answers reveals and cache-row requests (honestly: always).
    fn reveals(&self) -> bool {
        true
    }

    /// The throughput announced for a measured one (honestly: the measured one).
    fn announced_throughput(&self, measured: f32) -> f32 {
        measured
    }
}

/// The honest runner: runs the layers, signs what it computed, reveals what it kept.
#[derive(Debug, Default)]
pub struct Honest;

impl HopRunner for Honest {
    fn run(
        &self,
        model: &Model,
        gemm: &Gemm,
        x: Activations,
        cache: &mut KvCache,
        trace: &mut HopTrace,
        _hop: HopId,
    ) -> dc_model::Result<(Activations, KeptHop)> {
        model.run_layers_kept(gemm, x, cache, trace)
    }
}
