//! Where kernels put their results: the f32 output and, when asked, the exact accumulators.
//!
//! Every kernel hands each output element to [`Sink`] exactly once, either as an `i64` sum
//! with its exponent (fast paths) or as an [`Exact`] (reference and wide fallback). Both are
//! turned into the same canonical form and the same single rounding here, in one place.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::error::{KernelError, Result};
use crate::exact::{round_i64_fast, Exact};

/// The canonical form of one accumulator as stored in [`Accumulators`]: `mant · 2^exp`, with
/// `mant` odd or `(0, 0)`. A wide value is stored as `mant == 0, exp == i32::MIN` and kept whole
/// in [`Accumulators::wide`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Slot {
    /// Odd mantissa (0 for zero or for a wide value).
    pub mant: i64,
    /// Exponent (`i32::MIN` marks a wide value).
    pub exp: i32,
}

impl Slot {
    /// Marker of a value that lives in the wide table.
    pub const WIDE: Slot = Slot {
        mant: 0,
        exp: i32::MIN,
    };
}

/// The exact accumulators of one GEMM, row-major `rows × cols`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Accumulators {
    /// Rows of the output.
    pub rows: usize,
    /// Columns of the output.
    pub cols: usize,
    /// One slot per output element.
    pub slots: Vec<Slot>,
    /// The wide values, by flat index, sorted.
    pub wide: Vec<(usize, Exact)>,
}

impl Accumulators {
    /// The exact value of element `(row, col)`.
    pub fn get(&self, row: usize, col: usize) -> Exact {
        let i = row * self.cols + col;
        let s = self.slots[i];
        if s == Slot::WIDE {
            let at = self
                .wide
                .binary_search_by_key(&i, |w| w.0)
                .expect("every wide slot has a wide value");
            return self.wide[at].1.clone();
        }
        Exact::Small {
            mant: s.mant,
            exp: s.exp,
        }
    }
}

/// Shared write access to the outputs of one GEMM.
///
/// Kernels run on several threads; each output element belongs to exactly one task (tasks
/// split the columns by panel), so the raw writes never alias.
pub(crate) struct Sink {
    out: *mut f32,
    slots: Option<*mut Slot>,
    cols: usize,
    len: usize,
    wide: Mutex<Vec<(usize, Exact)>>,
    /// Smallest flat index whose result overflowed f32 (`usize::MAX`: none). Reporting the
    /// smallest makes the error the same whatever the kernel, tiling or thread timing.
    overflow: AtomicUsize,
}

// SAFETY: see the type's comment: disjoint writes only, enforced by the task split.
unsafe impl Sync for Sink {}
// SAFETY: as above.
unsafe impl Send for Sink {}

impl Sink {
    pub(crate) fn new(out: &mut [f32], cols: usize, slots: Option<&mut [Slot]>) -> Sink {
        Sink {
            len: out.len(),
            out: out.as_mut_ptr(),
            slots: slots.map(|s| s.as_mut_ptr()),
            cols,
            wide: Mutex::new(Vec::new()),
            overflow: AtomicUsize::new(usize::MAX),
        }
    }

    /// Whether the caller wants the exact accumulators.
    pub(crate) fn wants_slots(&self) -> bool {
        self.slots.is_some()
    }

    /// Where a kernel may store `len` finished f32 values of `row` from column `col` on, with
    /// its own (vector) stores; `None` when it must go through [`Sink::put_i64`] instead,
    /// because the exact accumulators are wanted or the run leaves the row.
    ///
    /// The caller must hold the task that owns those columns (tasks split columns by panel,
    /// so no other thread writes them), store only finite values, and only values equal to
    /// what [`Sink::put_i64`] would store.
    #[inline]
    pub(crate) fn out_run(&self, row: usize, col: usize, len: usize) -> Option<*mut f32> {
        if self.slots.is_some() || col + len > self.cols {
            return None;
        }
        let idx = row * self.cols + col;
        assert!(idx + len <= self.len, "sink run out of range");
        // SAFETY: idx + len <= len, inside the output slice.
        Some(unsafe { self.out.add(idx) })
    }

    /// Stores `sum · 2^exp` for element `(row, col)`.
    #[inline]
    pub(crate) fn put_i64(&self, row: usize, col: usize, sum: i64, exp: i32) -> Result<()> {
        let idx = row * self.cols + col;
        assert!(idx < self.len, "sink index out of range");
        let v = round_i64_fast(sum, exp);
        let v = if v.is_finite() {
            v
        } else {
            self.overflowed(idx)
        };
        // SAFETY: idx < len, and each index is written by exactly one task.
        unsafe { *self.out.add(idx) = v };
        if let Some(slots) = self.slots {
            let slot = if sum == 0 {
                Slot::default()
            } else {
                let tz = sum.trailing_zeros();
                Slot {
                    mant: sum >> tz,
                    exp: exp + tz as i32,
                }
            };
            // SAFETY: as above.
            unsafe { *slots.add(idx) = slot };
        }
        Ok(())
    }

    /// Stores an exact value for element `(row, col)`.
    pub(crate) fn put_exact(&self, row: usize, col: usize, value: Exact) -> Result<()> {
        let idx = row * self.cols + col;
        assert!(idx < self.len, "sink index out of range");
        let v = value.to_f32().unwrap_or_else(|| self.overflowed(idx));
        // SAFETY: idx < len, and each index is written by exactly one task.
        unsafe { *self.out.add(idx) = v };
        if let Some(slots) = self.slots {
            let slot = match value {
                Exact::Small { mant, exp } => Slot { mant, exp },
                wide @ Exact::Wide { .. } => {
                    self.wide
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((idx, wide));
                    Slot::WIDE
                }
            };
            // SAFETY: as above.
            unsafe { *slots.add(idx) = slot };
        }
        Ok(())
    }

    #[cold]
    fn overflowed(&self, idx: usize) -> f32 {
        self.overflow.fetch_min(idx, Ordering::Relaxed);
        f32::INFINITY
    }

    /// The overflow error of the first (row-major) element outside the f32 range, if any.
    pub(crate) fn overflow_error(&self) -> Result<()> {
        match self.overflow.load(Ordering::Relaxed) {
            usize::MAX => Ok(()),
            idx => Err(KernelError::Overflow {
                op: "gemm",
                row: idx / self.cols,
                col: idx % self.cols,
            }),
        }
    }

    pub(crate) fn into_wide(self) -> Vec<(usize, Exact)> {
        let mut w = self.wide.into_inner().unwrap_or_else(|e| e.into_inner());
        w.sort_by_key(|e| e.0);
        w
    }
}
