//! The exact product `Y = X · W` (NUMERICS.md §3): kernel selection, threading, and the one
//! place where results are rounded. Committing to them is the verification's business
//! (`verify::commit` adds those methods to [`Gemm`]); this module never hashes.
//!
//! Kernels differ only in how fast they compute the exact integer accumulators; all of them
//! hand every output to the same [`sink::Sink`], so a kernel can never round differently (or,
//! where a kernel rounds in its own vector code, it is tested to store exactly what the sink
//! would). Threads split the output columns by panel (`parallel.rs`): which thread computes an
//! element never changes its value, because every accumulator is an exact integer.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod parallel;
pub mod reference;
mod sink;

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

pub use sink::Accumulators;
pub(crate) use sink::WIDE;

use crate::error::{KernelError, Result};
use crate::pack::PackedWeights;
use crate::quant::QuantizedRows;
use sink::Sink;

/// An implementation of the exact product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Plain Rust, one element at a time: the reference every other kernel must equal.
    Scalar,
    /// AVX2 (`vpmaddubsw` / `vpmaddwd`).
    Avx2,
    /// AVX-512 with VNNI (`vpdpbusd`).
    Avx512,
    /// [`Kernel::Avx512`], with the block combination of tiles whose sums stay below 2^51 done
    /// by IFMA (`vpmadd52luq`) modulo 2^52: fewer instructions per block at prefill shapes.
    Avx512Ifma,
}

impl Kernel {
    /// Every kernel, reference first.
    pub const ALL: [Kernel; 4] = [
        Kernel::Scalar,
        Kernel::Avx2,
        Kernel::Avx512,
        Kernel::Avx512Ifma,
    ];

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            Kernel::Avx2 => "avx2",
            Kernel::Avx512 => "avx512",
            Kernel::Avx512Ifma => "avx512-ifma",
        }
    }

    /// Whether this CPU can run the kernel.
    pub fn is_supported(self) -> bool {
        match self {
            Kernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => avx512::supported(),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Ifma => avx512::supported() && is_x86_feature_detected!("avx512ifma"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The kernels this CPU supports, reference first.
    pub fn supported() -> Vec<Kernel> {
        Kernel::ALL
            .into_iter()
            .filter(|k| k.is_supported())
            .collect()
    }

    /// The fastest kernel this CPU supports.
    pub fn best() -> Kernel {
        *Kernel::supported().last().unwrap_or(&Kernel::Scalar)
    }

    /// Parses `auto`, `scalar`, `avx2`, `avx512` or `avx512-ifma`; `auto` picks
    /// [`Kernel::best`]. A kernel the CPU cannot run is an error.
    pub fn parse(s: &str) -> Result<Kernel> {
        let k = match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => return Ok(Kernel::best()),
            "scalar" => Kernel::Scalar,
            "avx2" => Kernel::Avx2,
            "avx512" | "avx512vnni" | "avx-512" => Kernel::Avx512,
            "avx512-ifma" | "avx512ifma" => Kernel::Avx512Ifma,
            _ => {
                return Err(KernelError::Invalid {
                    what: "kernel",
                    value: s.to_string(),
                    why: "expected auto, scalar, avx2, avx512 or avx512-ifma",
                })
            }
        };
        if !k.is_supported() {
            return Err(KernelError::Unsupported(k.name()));
        }
        Ok(k)
    }

    fn run(
        self,
        x: &QuantizedRows,
        w: &PackedWeights,
        panels: Range<usize>,
        sink: &Sink,
    ) -> Result<()> {
        let done = match self {
            Kernel::Scalar => reference::run(x, w, panels, sink),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => avx2::run(x, w, panels, sink),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => avx512::run(x, w, panels, sink, false),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Ifma => avx512::run(x, w, panels, sink, true),
            #[cfg(not(target_arch = "x86_64"))]
            _ => Err(KernelError::Unsupported(self.name())),
        };
        // The fast kernels store the exact sums non-temporally, which is weakly ordered: fenced
        // here, on the thread that stored them, before its task is seen as done.
        #[cfg(target_arch = "x86_64")]
        if sink.wants_slots() {
            // SAFETY: SSE is part of x86_64.
            unsafe { std::arch::x86_64::_mm_sfence() };
        }
        done
    }
}

/// Multiply-accumulates per second of the AVX2 kernel's 4-row tile alone on L1-resident data
/// (for [`crate::bench`]); `None` where AVX2 is missing.
pub(crate) fn avx2_tile_macs_per_second(time: std::time::Duration) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        avx2::tile_macs_per_second(time)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = time;
        None
    }
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A configured product engine: one kernel and a fixed pool of worker threads.
#[derive(Clone)]
pub struct Gemm {
    kernel: Kernel,
    threads: usize,
    pool: Option<Arc<rayon::ThreadPool>>,
    /// Sums buffers of this engine's dropped accumulators, for its next exact products.
    sums: Arc<sink::SumsPool>,
}

impl fmt::Debug for Gemm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gemm")
            .field("kernel", &self.kernel)
            .field("threads", &self.threads)
            .finish()
    }
}

/// Chunks of panels per thread: enough for the threads to even out, few enough that each
/// chunk streams a long run of weights.
const CHUNKS_PER_THREAD: usize = 8;

impl Gemm {
    /// An engine running `kernel` on `threads` threads (1 runs on the caller's thread).
    pub fn new(kernel: Kernel, threads: usize) -> Result<Gemm> {
        if !kernel.is_supported() {
            return Err(KernelError::Unsupported(kernel.name()));
        }
        if threads == 0 || threads > 1024 {
            return Err(KernelError::Invalid {
                what: "thread count",
                value: threads.to_string(),
                why: "expected 1 to 1024",
            });
        }
        let pool = if threads > 1 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("dc-gemm-{i}"))
                .build()
                .map_err(|_| KernelError::Invalid {
                    what: "thread pool",
                    value: threads.to_string(),
                    why: "the operating system refused to start the worker threads",
                })?;
            Some(Arc::new(pool))
        } else {
            None
        };
        Ok(Gemm {
            kernel,
            threads,
            pool,
            sums: Arc::default(),
        })
    }

    /// Runs `a` and `b`, side by side on this engine's threads when it has several (each may
    /// use the pool itself); one after the other otherwise.
    pub fn join<A: Send, B: Send>(
        &self,
        a: impl FnOnce() -> A + Send,
        b: impl FnOnce() -> B + Send,
    ) -> (A, B) {
        match &self.pool {
            Some(pool) => pool.install(|| rayon::join(a, b)),
            None => (a(), b()),
        }
    }

    /// The kernel in use.
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// The number of threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` on this engine's thread pool (so nested parallel work uses the same threads).
    pub fn install<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }

    /// `out = x · w`, row-major `x.rows() × w.n()`.
    pub fn matmul(&self, x: &QuantizedRows, w: &PackedWeights, out: &mut [f32]) -> Result<()> {
        self.run(x, w, out, None).map(|_| ())
    }

    /// `out = x · w`, also returning the exact accumulators (for commitments and audits).
    pub fn matmul_exact(
        &self,
        x: &QuantizedRows,
        w: &PackedWeights,
        out: &mut [f32],
    ) -> Result<Accumulators> {
        let (mut sums, mut row_unit) = self.sums.take(x.rows() * w.n());
        row_unit.extend((0..x.rows()).map(|r| x.meta(r).exp_min));
        let slots = sink::SlotsOut {
            sums: &mut sums,
            row_unit,
            col_unit: w.col_units(),
        };
        let (row_unit, col_unit, wide) = self.run(x, w, out, Some(slots))?;
        // SAFETY: `run` returned Ok, so the sink saw every slot written.
        let recycle = Some(self.sums.clone());
        Ok(unsafe {
            Accumulators::written(x.rows(), w.n(), sums, row_unit, col_unit, wide, recycle)
        })
    }

    fn run(
        &self,
        x: &QuantizedRows,
        w: &PackedWeights,
        out: &mut [f32],
        slots: Option<sink::SlotsOut<'_>>,
    ) -> Result<sink::Units> {
        if x.k() != w.k() {
            return Err(KernelError::Shape {
                op: "gemm",
                detail: format!("x has k = {} but w has k = {}", x.k(), w.k()),
            });
        }
        if out.len() != x.rows() * w.n() {
            return Err(KernelError::Shape {
                op: "gemm",
                detail: format!(
                    "output has {} elements, expected {} × {}",
                    out.len(),
                    x.rows(),
                    w.n()
                ),
            });
        }
        let sink = Sink::new(out, w.n(), slots);
        let panels = w.panels();
        match &self.pool {
            Some(pool) if panels > 1 => {
                let chunks = panels.min(self.threads * CHUNKS_PER_THREAD);
                parallel::run(pool, self.threads - 1, chunks, self.kernel, x, w, &sink)?;
            }
            _ => self.kernel.run(x, w, 0..panels, &sink)?,
        }
        sink.overflow_error()?;
        if !sink.wants_slots() {
            return Ok(Default::default());
        }
        // Every kernel hands every output to the sink; anything else is a kernel bug, and the
        // unwritten slots must never be read.
        assert!(
            sink.all_slots_written(),
            "{} kernel left exact accumulators unwritten ({} × {})",
            self.kernel,
            x.rows(),
            w.n()
        );
        Ok(sink.into_units())
    }
}
