//! Hops waiting to compute, and the batches run from them.
//!
//! A stage computes one batch of hops at a time. Hops that arrive meanwhile wait here, and
//! whichever of their tasks gets the batch slot next takes every waiting hop over the same
//! layers (up to [`MAX_HOP_ROWS`] rows and [`MAX_STACK`] hops) into one batch, run by
//! [`HopRunner::run_batch`]: concurrent generations' decode steps then read the weights once
//! between them, which is what a decode step is bound by. The bits and commitments are each
//! hop's own (see dc-model's `compute.rs`).
//!
//! Decode laps (a token and its guesses, at most [`SHORT_ROWS`] rows) and longer hops (a
//! prompt's) batch in two lanes, each with a batch computing at a time: one user's long prompt
//! never holds every other generation's next token behind it.
//!
//! Bounded: a hop waits here only after admission took its generation's cache, so there are
//! at most as many as the stage holds caches (`max_generations` and the audit sessions).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use dc_kernels::Gemm;
use dc_model::{Activations, KeptHop, KvCache};
use dc_types::HopTrace;
use tokio::sync::{oneshot, Semaphore};

use super::runner::{HopId, HopRunner, QueuedHop};
use crate::core::{Node, Serving};

/// Most positions one hop may carry, and one batch of hops (bounds the compute one request
/// can demand, and what one batch holds).
pub const MAX_HOP_ROWS: usize = 2048;

/// Most hops one batch stacks.
pub const MAX_STACK: usize = 16;

/// Most rows of a hop in the decode lane: one token and the most a head guesses after it.
pub const SHORT_ROWS: usize = 1 + dc_model::speculative::MAX_DRAFT;

/// The lane of a hop of `rows` rows: 0 for decode laps, 1 for longer hops.
fn lane(rows: usize) -> usize {
    usize::from(rows > SHORT_ROWS)
}

/// What computing a hop gave: the output and what is kept, its trace, and its cache back.
pub(super) type Computed = (dc_model::Result<(Activations, KeptHop)>, HopTrace, KvCache);

/// A hop admitted and waiting for a batch.
#[derive(Debug)]
struct Waiting {
    ticket: u64,
    serving: Arc<Serving>,
    x: Activations,
    cache: KvCache,
    hop: HopId,
    keep: bool,
    done: oneshot::Sender<Computed>,
}

/// The hops admitted and waiting for a batch, and what runs the batches.
#[derive(Debug)]
pub(super) struct HopQueue {
    node: Arc<Node>,
    runner: Arc<dyn HopRunner>,
    /// The stage's compute slots, which its audit replays take too.
    compute: Arc<Semaphore>,
    waiting: Mutex<Vec<Waiting>>,
    /// Held by the task running a batch of hops, one per lane: one batch per lane computes
    /// at a time, and what arrives meanwhile forms the next.
    batch_slots: [Arc<Semaphore>; 2],
    /// Names each waiting hop.
    tickets: AtomicU64,
}

impl HopQueue {
    /// An empty queue whose batches run with `runner` in `compute`'s slots.
    pub(super) fn new(
        node: Arc<Node>,
        runner: Arc<dyn HopRunner>,
        compute: Arc<Semaphore>,
    ) -> Self {
        HopQueue {
            node,
            runner,
            compute,
            waiting: Mutex::new(Vec::new()),
            batch_slots: [Arc::new(Semaphore::new(1)), Arc::new(Semaphore::new(1))],
            tickets: AtomicU64::new(0),
        }
    }

    /// Computes hop `hop` over `x` on `cache` (keeping what a reveal needs when `keep`), in a
    /// batch with whatever other hops are waiting when its turn comes. `Err` when the compute
    /// task failed (the cache is then lost).
    pub(super) async fn compute(
        &self,
        serving: Arc<Serving>,
        x: Activations,
        cache: KvCache,
        (hop, keep): (HopId, bool),
    ) -> Result<Computed, String> {
        let (done, result) = oneshot::channel();
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        let lane = lane(x.rows());
        self.waiting(|w| {
            w.push(Waiting {
                ticket,
                serving,
                x,
                cache,
                hop,
                keep,
                done,
            })
        });
        let slot = self.batch_slots[lane]
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| "shutting down".to_string())?;
        // Empty when another task's batch took this hop: its result comes from there.
        let batch = self.waiting(|w| take_batch(w, ticket));
        if !batch.is_empty() {
            let Ok(_permit) = self.compute.clone().acquire_owned().await else {
                return Err("shutting down".into());
            };
            if batch.len() > 1 {
                let stacked = batch.len() as u64;
                self.node
                    .stats
                    .stacked_hops
                    .fetch_add(stacked, Ordering::Relaxed);
            }
            let (runner, gemm) = (self.runner.clone(), self.node.gemm.clone());
            // A panic drops the batch's senders: each hop's task then reports the failure.
            let _ = tokio::task::spawn_blocking(move || run_batch(&*runner, &gemm, batch)).await;
        }
        drop(slot);
        result
            .await
            .map_err(|_| "the compute task failed".to_string())
    }

    fn waiting<T>(&self, f: impl FnOnce(&mut Vec<Waiting>) -> T) -> T {
        f(&mut self.waiting.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Takes from `waiting` the hop `ticket`, if it still waits, and every other waiting hop
/// that can run with it: in the same lane, on the same loaded model and layers, within the
/// bounds of a batch.
fn take_batch(waiting: &mut Vec<Waiting>, ticket: u64) -> Vec<Waiting> {
    let Some(at) = waiting.iter().position(|w| w.ticket == ticket) else {
        return Vec::new();
    };
    let first = waiting.remove(at);
    let (layers, mut rows) = (first.cache.layers(), first.x.rows());
    let first_lane = lane(rows);
    let mut batch = vec![first];
    let mut i = 0;
    while i < waiting.len() && batch.len() < MAX_STACK {
        let w = &waiting[i];
        let fits = lane(w.x.rows()) == first_lane
            && Arc::ptr_eq(&w.serving, &batch[0].serving)
            && w.cache.layers() == layers
            && rows + w.x.rows() <= MAX_HOP_ROWS;
        if fits {
            rows += w.x.rows();
            batch.push(waiting.remove(i));
        } else {
            i += 1;
        }
    }
    batch
}

/// Runs `batch` and hands each hop its result. The whole batch runs on the engine's pool: a
/// decode hop is dozens of short products, and handing each layer to the pool from outside
/// costs a wake-up of its threads every time.
fn run_batch(runner: &dyn HopRunner, gemm: &Gemm, batch: Vec<Waiting>) {
    let serving = batch[0].serving.clone();
    let mut parts: Vec<(KvCache, HopTrace, oneshot::Sender<Computed>)> = Vec::new();
    let mut inputs = Vec::with_capacity(batch.len());
    for w in batch {
        inputs.push((w.x, w.hop, w.keep));
        parts.push((w.cache, HopTrace::from_position(0), w.done));
    }
    let hops = parts
        .iter_mut()
        .zip(inputs)
        .map(|((cache, trace, _), (x, hop, keep))| {
            *trace = HopTrace::from_position(x.start);
            QueuedHop {
                x,
                cache,
                trace,
                hop,
                keep,
            }
        })
        .collect();
    let results = gemm.install(|| runner.run_batch(&serving.model, gemm, hops));
    for (result, (cache, trace, done)) in results.into_iter().zip(parts) {
        // (A hop whose task has gone, its requester disconnected, is dropped.)
        let _ = done.send((result, trace, cache));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report

    use std::ops::Range;

    use dc_model::{LoadOptions, Model};
    use dc_types::{GenerationId, LayerRange};

    use super::*;

    /// A waiting hop of `rows` rows over `layers` of `serving`'s model.
    fn hop(serving: &Arc<Serving>, ticket: u64, rows: usize, layers: Range<usize>) -> Waiting {
        let cfg = &serving.model.config;
        Waiting {
            ticket,
            serving: serving.clone(),
            x: Activations {
                start: 0,
                hidden: cfg.hidden_size,
                data: vec![0.0; rows * cfg.hidden_size],
            },
            cache: KvCache::new(cfg, layers),
            hop: HopId {
                generation: GenerationId([ticket as u8; 16]),
                step: 0,
            },
            keep: true,
            done: oneshot::channel().0,
        }
    }

    fn tickets(batch: &[Waiting]) -> Vec<u64> {
        batch.iter().map(|w| w.ticket).collect()
    }

    #[test]
    fn a_batch_takes_the_hops_of_its_lane_and_layers_up_to_the_bounds() {
        let fixture =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/llama");
        let model = Arc::new(Model::load(&fixture, &LoadOptions::default()).unwrap());
        let serving = Arc::new(Serving {
            model: model.clone(),
            layers: LayerRange::new(0, 4).unwrap(),
            head: false,
        });
        // Another serving of the same model (its layers loaded again): never stacked with the
        // first.
        let other = Arc::new(Serving {
            model,
            layers: LayerRange::new(0, 4).unwrap(),
            head: false,
        });
        let mut waiting = vec![
            hop(&serving, 0, 1, 0..4),
            hop(&serving, 1, 40, 0..4),
            hop(&serving, 2, SHORT_ROWS, 0..4),
            hop(&serving, 3, 1, 0..2),
            hop(&other, 4, 1, 0..4),
            hop(&serving, 5, SHORT_ROWS + 1, 0..4),
            hop(&serving, 6, 2, 0..4),
        ];
        // A decode lap takes the other decode laps on its layers and serving, in arrival order.
        assert_eq!(tickets(&take_batch(&mut waiting, 2)), [2, 0, 6]);
        // A prompt's hop takes the other long hops, never a decode lap.
        assert_eq!(tickets(&take_batch(&mut waiting, 5)), [5, 1]);
        // A hop another batch took yields nothing.
        assert!(take_batch(&mut waiting, 0).is_empty());
        assert_eq!(tickets(&waiting), [3, 4]);

        // At most MAX_STACK hops, and at most MAX_HOP_ROWS rows, in one batch.
        let mut many: Vec<Waiting> = (0..MAX_STACK as u64 + 3)
            .map(|t| hop(&serving, t, 1, 0..4))
            .collect();
        assert_eq!(take_batch(&mut many, 0).len(), MAX_STACK);
        assert_eq!(many.len(), 3);
        let big = MAX_HOP_ROWS / 2 + 1;
        let mut long = vec![
            hop(&serving, 0, big, 0..4),
            hop(&serving, 1, big, 0..4),
            hop(&serving, 2, MAX_HOP_ROWS - big, 0..4),
        ];
        assert_eq!(tickets(&take_batch(&mut long, 0)), [0, 2]);
    }
}
