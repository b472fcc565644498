//! The stage's state: the KV caches it keeps for the generations it serves, the compute slots
//! its hops and audit replays take, the hops waiting to be batched, and the [`HopRunner`] that
//! computes them. Requests reach it through the methods in `hop.rs` (hops), `queue.rs` (their
//! batches), `reveal.rs` (reveals and cache rows) and `replay.rs` (audits of other stages); the
//! node's shared state is read through `node`.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use dc_types::GenerationId;
use tokio::sync::Semaphore;

use super::caches::StageCaches;
use super::queue::HopQueue;
use super::runner::HopRunner;
use crate::core::Node;

/// Reveals and cache-row answers assembled at once; more wait their turn.
pub const REVEALS_AT_ONCE: usize = 4;

/// The stage this daemon serves.
#[derive(Debug)]
pub struct Stage {
    /// The node's shared state.
    pub node: Arc<Node>,
    caches: Mutex<StageCaches>,
    /// Bounds the hops (and audit replays) computing at once.
    pub(super) compute: Arc<Semaphore>,
    /// Bounds the reveals and cache-row answers assembled at once (their own slots, so a
    /// flood of them neither starves the hops nor waits behind them); the rest wait in turn.
    pub(super) reveal_slots: Arc<Semaphore>,
    /// The most reveals assembled at once so far (status, and the test of the bound).
    pub(super) reveals_peak: std::sync::atomic::AtomicUsize,
    /// Computes the hops.
    pub(super) runner: Arc<dyn HopRunner>,
    /// Hops admitted and waiting for a batch, and the batches run from them (`queue.rs`).
    pub(super) queue: HopQueue,
}

impl Stage {
    /// A stage of `node` computing its hops with `runner`.
    pub fn new(node: Arc<Node>, runner: Arc<dyn HopRunner>) -> Stage {
        let compute = Arc::new(Semaphore::new(node.cfg.threads.max(1) * 2));
        Stage {
            caches: Mutex::new(StageCaches::default()),
            reveal_slots: Arc::new(Semaphore::new(REVEALS_AT_ONCE)),
            reveals_peak: std::sync::atomic::AtomicUsize::new(0),
            queue: HopQueue::new(node.clone(), runner.clone(), compute.clone()),
            node,
            runner,
            compute,
        }
    }

    /// Runs `f` on the caches, then tells the node how many generations they hold.
    pub(super) fn caches<T>(&self, f: impl FnOnce(&mut StageCaches) -> T) -> T {
        let mut caches = self.caches.lock().unwrap_or_else(|e| e.into_inner());
        let out = f(&mut caches);
        let held = u32::try_from(caches.len()).unwrap_or(u32::MAX);
        self.node
            .stats
            .stage_generations
            .store(held, Ordering::Relaxed);
        out
    }

    /// Ends generation (or audit session) `g` here, if `owner` started it.
    pub fn end(&self, g: &GenerationId, owner: &str) -> bool {
        self.caches(|c| c.end(g, owner))
    }

    /// Drops the caches idle for longer than the configured timeout; returns how many.
    pub fn expire(&self) -> usize {
        let idle = self.node.cfg.generation_idle_timeout;
        self.caches(|c| c.expire(std::time::Instant::now(), idle))
    }

    /// Bytes held by the caches not in use.
    pub fn cache_bytes(&self) -> usize {
        self.caches(|c| c.bytes())
    }

    /// Waits for a reveal slot (see [`Stage::reveal_slots`]) and notes the peak in use.
    pub(super) async fn reveal_slot(&self) -> Result<tokio::sync::OwnedSemaphorePermit, String> {
        let permit = self
            .reveal_slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| "the stage is shutting down".to_string())?;
        let in_use = REVEALS_AT_ONCE - self.reveal_slots.available_permits();
        self.reveals_peak.fetch_max(in_use, Ordering::Relaxed);
        Ok(permit)
    }

    /// The most reveals assembled at once so far.
    pub fn reveals_peak(&self) -> usize {
        self.reveals_peak.load(Ordering::Relaxed)
    }

    /// The throughput to announce for the measured one.
    pub fn announced_throughput(&self, measured: f32) -> f32 {
        self.runner.announced_throughput(measured)
    }
}
