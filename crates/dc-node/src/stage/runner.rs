//! How this daemon computes and presents a hop: the one seam where a test daemon's lies are
//! plugged in. The stage calls a [`HopRunner`] chosen once at start; the honest one runs the
//! layers and changes nothing, and the test-only fault decorator (`fault.rs`, built with the
//! `fault-injection` feature) wraps the same calls to lie. The honest path has no branch for
//! faults.

use dc_kernels::{Commitment, Gemm};
use dc_model::{Activations, HopInput, KeptHop, KvCache, Model};
use dc_types::{GenerationId, HopTrace};

/// Which hop: its generation and step.
#[derive(Clone, Copy, Debug)]
pub struct HopId {
    /// The generation.
    pub generation: GenerationId,
    /// The step (0 for the first hop of a generation).
    pub step: u64,
}

/// One hop of a batch: what [`HopRunner::run`] takes, for several generations' hops that
/// arrived together.
#[derive(Debug)]
pub struct QueuedHop<'a> {
    /// The activations entering the stage.
    pub x: Activations,
    /// The generation's cache.
    pub cache: &'a mut KvCache,
    /// Where the hop's commitments go.
    pub trace: &'a mut HopTrace,
    /// Which hop.
    pub hop: HopId,
    /// Whether a reveal may ask for it (not a head's own hop): then what it needs is kept.
    pub keep: bool,
}

impl QueuedHop<'_> {
    /// The hop as the model runs it (its input copied: a failed stack runs it again).
    fn input(&mut self) -> HopInput<'_> {
        HopInput {
            x: self.x.clone(),
            cache: &mut *self.cache,
            trace: &mut *self.trace,
            keep: self.keep,
        }
    }
}

/// What running one hop gives: its output and what is kept to reveal it.
pub type HopResult = dc_model::Result<(Activations, KeptHop)>;

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
    ) -> HopResult;

    /// Runs several generations' hops over the same layers, each result what
    /// [`HopRunner::run`] would give it (by default, one after another).
    fn run_batch(&self, model: &Model, gemm: &Gemm, hops: Vec<QueuedHop<'_>>) -> Vec<HopResult> {
        hops.into_iter()
            .map(|h| self.run(model, gemm, h.x, h.cache, h.trace, h.hop))
            .collect()
    }

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
    ) -> HopResult {
        model.run_layers_kept(gemm, x, cache, trace)
    }

    /// The hops stacked, each weight product one GEMM over all their rows
    /// ([`Model::run_hops_kept`]: the same bits and commitments as one by one), a hop nobody
    /// will ask to reveal only committed. If a stack fails, every hop runs again alone, so only
    /// a hop that fails by itself fails.
    fn run_batch(&self, model: &Model, gemm: &Gemm, hops: Vec<QueuedHop<'_>>) -> Vec<HopResult> {
        let mut hops = hops;
        let inputs = hops.iter_mut().map(QueuedHop::input).collect();
        match model.run_hops_kept(gemm, inputs) {
            Ok(done) => done.into_iter().map(Ok).collect(),
            Err(e) if hops.len() == 1 => vec![Err(e)],
            Err(e) => {
                tracing::debug!(
                    "a stack of {} hops failed ({e}); running each alone",
                    hops.len()
                );
                hops.iter_mut()
                    .map(|h| {
                        *h.trace = HopTrace::from_position(h.trace.from);
                        let mut one = model.run_hops_kept(gemm, vec![h.input()])?;
                        Ok(one.remove(0))
                    })
                    .collect()
            }
        }
    }
}
