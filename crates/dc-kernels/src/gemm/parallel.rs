//! How one product is shared between the calling thread and the pool's workers.
//!
//! The columns are cut into chunks of panels that threads take one at a time from a counter.
//! The calling thread starts at once and the workers join as they wake; the caller then waits
//! only for workers that actually took part, never for one that has not woken up yet (a
//! decode product takes tens of microseconds, about what waking a sleeping thread can cost).
//! Which thread computes a column never changes its value: every accumulator is an exact
//! integer, and the first failing chunk in column order is the error, whatever the timing.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::sink::Sink;
use super::Kernel;
use crate::error::{KernelError, Result};
use crate::pack::PackedWeights;
use crate::quant::QuantizedRows;

/// Set in [`Shared::state`] once the caller has finished its own share: from then on no
/// worker may start, and the caller only waits for those already inside.
const CLOSED: usize = 1 << (usize::BITS - 1);

/// One product's work, shared with the pool's workers through an `Arc`.
struct Shared {
    kernel: Kernel,
    x: *const QuantizedRows,
    w: *const PackedWeights,
    sink: *const Sink,
    panels: usize,
    chunks: usize,
    /// The next chunk to take.
    next: AtomicUsize,
    /// Workers inside [`Shared::work`] (low bits) and [`CLOSED`].
    state: AtomicUsize,
    /// The first failing chunk and its error.
    failed: Mutex<Option<(usize, KernelError)>>,
}

// SAFETY: the raw pointers are only dereferenced by the caller of `run`, which borrows their
// referents for its whole duration, and by workers between a successful `enter` and the
// matching `leave`; `run` does not return before it has set CLOSED (so no further `enter`
// succeeds) and seen every entered worker leave. Everything else in `Shared` is Sync.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    /// Registers a worker; `false` once the product is closed (then it must not touch it).
    fn enter(&self) -> bool {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            if s & CLOSED != 0 {
                return false;
            }
            match self
                .state
                .compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(now) => s = now,
            }
        }
    }

    /// Takes chunks until none is left.
    ///
    /// # Safety
    /// The pointers must be live: called by `run`'s caller, or by a worker that entered.
    unsafe fn work(&self) {
        loop {
            let c = self.next.fetch_add(1, Ordering::Relaxed);
            if c >= self.chunks {
                return;
            }
            let range: Range<usize> =
                (c * self.panels / self.chunks)..((c + 1) * self.panels / self.chunks);
            // SAFETY: per this function's contract.
            let (x, w, sink) = unsafe { (&*self.x, &*self.w, &*self.sink) };
            if let Err(e) = self.kernel.run(x, w, range, sink) {
                let mut f = self.failed.lock().unwrap_or_else(|e| e.into_inner());
                if f.as_ref().is_none_or(|(first, _)| c < *first) {
                    *f = Some((c, e));
                }
            }
        }
    }
}

/// Leaves [`Shared::state`] when dropped, so a worker is counted out even if it unwinds.
struct Leave<'a>(&'a Shared);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        // Release: the worker's outputs happen before the caller sees it leave.
        self.0.state.fetch_sub(1, Ordering::Release);
    }
}

/// Closes [`Shared::state`] when dropped and waits until every worker that entered has left.
struct Close<'a>(&'a Shared);

impl Drop for Close<'_> {
    fn drop(&mut self) {
        self.0.state.fetch_or(CLOSED, Ordering::AcqRel);
        // The workers still inside are finishing their last chunk (all chunks are taken).
        let mut spins = 0u32;
        while self.0.state.load(Ordering::Acquire) & !CLOSED != 0 {
            if spins < 1 << 10 {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// Runs `kernel` over all panels of `w` in `chunks` chunks, on the calling thread and up to
/// `helpers` workers of `pool`.
pub(super) fn run(
    pool: &rayon::ThreadPool,
    helpers: usize,
    chunks: usize,
    kernel: Kernel,
    x: &QuantizedRows,
    w: &PackedWeights,
    sink: &Sink,
) -> Result<()> {
    let shared = Arc::new(Shared {
        kernel,
        x,
        w,
        sink,
        panels: w.panels(),
        chunks,
        next: AtomicUsize::new(0),
        state: AtomicUsize::new(0),
        failed: Mutex::new(None),
    });
    for _ in 0..helpers {
        let s = Arc::clone(&shared);
        pool.spawn(move || {
            if s.enter() {
                let _leave = Leave(&s);
                // SAFETY: entered, so the caller keeps the referents alive until we leave.
                unsafe { s.work() };
            }
        });
    }
    {
        // Closes the product and waits for the workers inside before the borrows end, also
        // if this thread unwinds.
        let _close = Close(&shared);
        // SAFETY: this thread borrows x, w and sink for the whole call.
        unsafe { shared.work() };
    }
    let failed = shared
        .failed
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    match failed {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}
