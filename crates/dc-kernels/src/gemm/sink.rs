//! Where kernels put their results: the f32 output and, when asked, the exact accumulators.
//!
//! Every kernel hands each output element to [`Sink`] exactly once, either as an `i64` sum
//! with its exponent (fast paths) or as an [`Exact`] (reference and wide fallback). Both are
//! turned into the same canonical form and the same single rounding here, in one place.
//!
//! The slots of the exact accumulators start uninitialised (clearing megabytes of them only
//! to overwrite every one was a measurable share of a committed prefill); the sink records
//! which it has written, one bit per slot, and hands them out only when every bit is set.

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::error::{KernelError, Result};
use crate::exact::{round_i64_fast, Exact};
use crate::pack::PANEL;

/// The canonical form of one accumulator as stored in [`Accumulators`]: `mant · 2^exp`, with
/// `mant` odd or `(0, 0)`. A wide value is stored as `mant == 0, exp == i32::MIN` and kept whole
/// in [`Accumulators::wide`].
///
/// `repr(C)`: the AVX2 kernel stores slots with vector instructions (`mant` at byte 0, `exp` at
/// byte 8, 16 bytes in all).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[repr(C)]
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

/// Slots for `len` outputs, not yet written (see [`Sink::new`]).
pub(crate) fn unwritten_slots(len: usize) -> Vec<MaybeUninit<Slot>> {
    let mut v = Vec::with_capacity(len);
    // SAFETY: `MaybeUninit` needs no initialisation, and the capacity is `len`.
    unsafe { v.set_len(len) };
    v
}

/// The slots a [`Sink`] has written, every one of them (checked by [`Sink::all_slots_written`]).
///
/// # Safety
/// Every element of `slots` must be initialised.
pub(crate) unsafe fn written_slots(slots: Vec<MaybeUninit<Slot>>) -> Vec<Slot> {
    let mut slots = std::mem::ManuallyDrop::new(slots);
    let (ptr, len, cap) = (slots.as_mut_ptr(), slots.len(), slots.capacity());
    // SAFETY: same allocation, layout (`MaybeUninit<T>` has `T`'s) and length; every element is
    // initialised per the caller.
    unsafe { Vec::from_raw_parts(ptr as *mut Slot, len, cap) }
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
    /// With slots: one bit per slot written, a 16-bit mask per (row, panel of [`PANEL`]
    /// columns). A (row, panel) belongs to one task, so each mask has a single writer (plain
    /// relaxed loads and stores, no read-modify-write instruction).
    written: Vec<AtomicU16>,
    /// Panels per row.
    panels: usize,
    cols: usize,
    len: usize,
    wide: Mutex<Vec<(usize, Exact)>>,
    /// Smallest flat index whose result overflowed f32 (`usize::MAX`: none). Reporting the
    /// smallest makes the error the same whatever the kernel, tiling or thread timing.
    overflow: AtomicUsize,
}

/// A run of outputs a kernel stores itself (see [`Sink::run`]).
pub(crate) struct Run<'a> {
    /// The first f32 output of the run.
    pub(crate) out: *mut f32,
    /// The first slot of the run, when the exact accumulators are wanted (uninitialised
    /// memory: write only, then call [`Run::slots_written`]).
    pub(crate) slots: Option<*mut Slot>,
    sink: &'a Sink,
    row: usize,
    col: usize,
    len: usize,
}

impl Run<'_> {
    /// Records that every slot of the run has been stored.
    #[inline]
    pub(crate) fn slots_written(&self) {
        self.sink.mark(self.row, self.col, self.len);
    }
}

// SAFETY: see the type's comment: disjoint writes only, enforced by the task split.
unsafe impl Sync for Sink {}
// SAFETY: as above.
unsafe impl Send for Sink {}

impl Sink {
    /// A sink writing `out` (row-major, `cols` columns) and, when given, `slots` (as many,
    /// possibly uninitialised: the sink only writes them).
    pub(crate) fn new(
        out: &mut [f32],
        cols: usize,
        slots: Option<&mut [MaybeUninit<Slot>]>,
    ) -> Sink {
        let panels = cols.div_ceil(PANEL);
        let rows = out.len().checked_div(cols).unwrap_or(0);
        let slots = slots.map(|s| {
            assert_eq!(s.len(), out.len(), "one slot per output");
            s.as_mut_ptr() as *mut Slot
        });
        let masks = if slots.is_some() { rows * panels } else { 0 };
        Sink {
            len: out.len(),
            out: out.as_mut_ptr(),
            slots,
            written: (0..masks).map(|_| AtomicU16::new(0)).collect(),
            panels,
            cols,
            wide: Mutex::new(Vec::new()),
            overflow: AtomicUsize::new(usize::MAX),
        }
    }

    /// Records slots `col .. col + len` of `row` as written (all in one panel).
    #[inline]
    fn mark(&self, row: usize, col: usize, len: usize) {
        let (panel, first) = (col / PANEL, col % PANEL);
        debug_assert!(first + len <= PANEL);
        let bits = ((1u32 << len) - 1) << first;
        let m = &self.written[row * self.panels + panel];
        // Single writer per mask (see the field): load and store, not `fetch_or`.
        m.store(m.load(Ordering::Relaxed) | bits as u16, Ordering::Relaxed);
    }

    /// Whether every slot has been written (call after all tasks have finished).
    pub(crate) fn all_slots_written(&self) -> bool {
        if self.slots.is_none() {
            return false;
        }
        let last = match self.cols % PANEL {
            0 => u16::MAX,
            r => (1u16 << r) - 1,
        };
        self.written.chunks_exact(self.panels.max(1)).all(|row| {
            row.iter().enumerate().all(|(p, m)| {
                let full = if p + 1 == self.panels { last } else { u16::MAX };
                m.load(Ordering::Relaxed) == full
            })
        })
    }

    /// Whether the caller wants the exact accumulators.
    pub(crate) fn wants_slots(&self) -> bool {
        self.slots.is_some()
    }

    /// Where a kernel may store `len` finished results of `row` from column `col` on, with its
    /// own (vector) stores: the f32 outputs and, when the exact accumulators are wanted, their
    /// slots. `None` when the run leaves the row (then it must go through [`Sink::put_i64`]).
    ///
    /// The caller must hold the task that owns those columns (tasks split columns by panel,
    /// so no other thread writes them), and store only what [`Sink::put_i64`] would store:
    /// finite f32 values, and canonical small slots (a wide value must go through
    /// [`Sink::put_exact`]).
    #[inline]
    pub(crate) fn run(&self, row: usize, col: usize, len: usize) -> Option<Run<'_>> {
        if col + len > self.cols || (self.slots.is_some() && col % PANEL + len > PANEL) {
            return None;
        }
        let idx = row * self.cols + col;
        assert!(idx + len <= self.len, "sink run out of range");
        // SAFETY: idx + len <= len, inside the output slice and the slots (same length).
        unsafe {
            Some(Run {
                out: self.out.add(idx),
                slots: self.slots.map(|s| s.add(idx)),
                sink: self,
                row,
                col,
                len,
            })
        }
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
            // SAFETY: as above (a write: the slot may be uninitialised).
            unsafe { slots.add(idx).write(slot) };
            self.mark(row, col, 1);
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
            // SAFETY: as above (a write: the slot may be uninitialised).
            unsafe { slots.add(idx).write(slot) };
            self.mark(row, col, 1);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_handed_out_only_when_every_one_was_written() {
        // 3 rows × 21 columns: a full panel and a partial one of 5 columns.
        let (rows, cols) = (3, 21);
        let mut out = vec![0f32; rows * cols];
        let mut slots = unwritten_slots(rows * cols);
        let sink = Sink::new(&mut out, cols, Some(&mut slots));
        for r in 0..rows {
            let run = sink.run(r, 0, PANEL).expect("a full panel");
            for c in 0..PANEL {
                // SAFETY: the run's slots are ours and in range.
                unsafe {
                    run.slots
                        .expect("slots wanted")
                        .add(c)
                        .write(Slot::default())
                };
            }
            run.slots_written();
            assert!(sink.run(r, PANEL, PANEL).is_none(), "past the last column");
            for c in PANEL..cols {
                if (r, c) != (2, 20) {
                    sink.put_i64(r, c, 6, 0).expect("finite");
                }
            }
        }
        assert!(!sink.all_slots_written(), "slot (2, 20) is missing");
        // Writing one slot twice does not stand in for another.
        sink.put_i64(2, 19, 6, 0).expect("finite");
        assert!(!sink.all_slots_written());
        sink.put_exact(2, 20, Exact::from_i64(-3, 4))
            .expect("finite");
        assert!(sink.all_slots_written());
        drop(sink);
        // SAFETY: every slot was written (checked above).
        let slots = unsafe { written_slots(slots) };
        assert_eq!(slots[cols - 1], Slot { mant: 3, exp: 1 });
        assert_eq!(slots[3 * cols - 1], Slot { mant: -3, exp: 4 });
    }

    #[test]
    fn empty_products_have_all_their_slots() {
        for (rows, cols) in [(0, 5), (4, 0), (0, 0)] {
            let mut out = vec![0f32; rows * cols];
            let mut slots = unwritten_slots(rows * cols);
            let sink = Sink::new(&mut out, cols, Some(&mut slots));
            assert!(sink.all_slots_written(), "{rows} × {cols}");
        }
    }
}
