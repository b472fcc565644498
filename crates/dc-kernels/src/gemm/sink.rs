//! Where kernels put their results: the f32 output and, when asked, the exact accumulators.
//!
//! Every kernel hands each output element to [`Sink`] exactly once, either as an `i64` sum
//! with its exponent (fast paths) or as an [`Exact`] (reference and wide fallback). Both get
//! the same single rounding here, in one place, and the same stored accumulator: the value as
//! an integer in its row's and column's unit (see [`Accumulators`]).
//!
//! The slots of the exact accumulators start uninitialised (clearing megabytes of them only
//! to overwrite every one was a measurable share of a committed prefill); the sink records
//! which it has written, one bit per slot, and hands them out only when every bit is set.
//!
//! A dropped [`Accumulators`] hands its sums' buffer back to the engine that made it
//! ([`SumsPool`]), for that engine's next product of the same size.

use std::fmt;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{KernelError, Result};
use crate::exact::{round_i64_fast, Exact};
use crate::pack::PANEL;

/// Marks an element of [`Accumulators`] whose sum does not fit an `i64` in its unit: the value
/// is kept whole in the wide table. No fast kernel's sum is ever this (they stay below 2^63 in
/// magnitude).
pub(crate) const WIDE: i64 = i64::MIN;

/// The exact accumulators of one GEMM, row-major `rows × cols`.
///
/// Each element is stored as the integer it is in units of `2^(row_unit[row] +
/// col_unit[col])` (the smallest block exponents of its row and column): exactly the `i64` sum
/// the fast kernels add up, so keeping a product's accumulators costs them one 8-byte store per
/// output and no canonical form (that is computed for the few rows a reveal asks for, by
/// [`Accumulators::get`]). An element whose integer does not fit (only the reference path's
/// wide exponent spans) is marked [`WIDE`] and kept whole in a table. Equality is of the
/// values, not of how they are stored.
#[derive(Clone, Debug, Default)]
pub struct Accumulators {
    /// Rows of the output.
    pub rows: usize,
    /// Columns of the output.
    pub cols: usize,
    sums: Vec<i64>,
    row_unit: Vec<i32>,
    /// At least `cols` entries (the packed weights' padded columns share the list).
    col_unit: Arc<[i32]>,
    /// The wide values, by flat index, sorted.
    wide: Vec<(usize, Exact)>,
    /// Where `sums`' buffer goes when these are dropped: the pool of the engine that made them.
    recycle: Option<Arc<SumsPool>>,
}

impl Drop for Accumulators {
    fn drop(&mut self) {
        if let Some(pool) = self.recycle.take() {
            pool.give(
                std::mem::take(&mut self.sums),
                std::mem::take(&mut self.row_unit),
            );
        }
    }
}

/// The buffers of dropped [`Accumulators`] (sums and row units), kept by an engine for its
/// next products of the same sizes.
///
/// Why: a stage keeps every hop's accumulators for a few hops and then drops them, some
/// fifteen buffers per layer. By then their memory has gone cold (the weights streamed through the
/// caches since), and the system allocator's free, and its next malloc, walk chunk headers in
/// it, consolidating neighbours: on a SmolLM2 stage that churn cost about a quarter of what
/// keeping costs. A pooled buffer costs a lock and a lookup; its old contents never show,
/// since the sink hands out accumulators only when it wrote every slot.
///
/// Bounded: at most [`SumsPool::BYTES`] in all, and only buffers of up to
/// [`SumsPool::LARGEST`] (decode-sized products; a prefill's large buffers, whose sizes vary
/// with the chunk, go back to the allocator).
#[derive(Default)]
pub(crate) struct SumsPool {
    free: Mutex<FreeSums>,
}

/// The buffers a [`SumsPool`] holds, by the sums' length (a stage's products come in a
/// handful of sizes: a short list searched in order beats hashing).
#[derive(Default)]
struct FreeSums {
    by_len: Vec<(usize, Vec<Buffers>)>,
    bytes: usize,
}

/// One product's buffers: its sums and its row units.
type Buffers = (Vec<i64>, Vec<i32>);

impl fmt::Debug for SumsPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bytes = self.free.lock().map(|f| f.bytes).unwrap_or(0);
        f.debug_struct("SumsPool").field("bytes", &bytes).finish()
    }
}

impl SumsPool {
    /// Bytes a pool holds at most.
    pub(crate) const BYTES: usize = 32 << 20;
    /// The largest buffer a pool keeps, in bytes.
    pub(crate) const LARGEST: usize = 256 << 10;
    /// Sizes a pool keeps buffers of at most.
    const SIZES: usize = 32;

    /// A buffer of exactly `len` sums (uninitialised) and an empty one for row units, from
    /// the pool when it has them.
    pub(crate) fn take(&self, len: usize) -> (Vec<MaybeUninit<i64>>, Vec<i32>) {
        let pooled = self.free.lock().ok().and_then(|mut free| {
            let (_, list) = free.by_len.iter_mut().find(|(l, _)| *l == len)?;
            let v = list.pop()?;
            free.bytes -= len * 8;
            Some(v)
        });
        match pooled {
            Some((v, mut row_unit)) => {
                let mut v = std::mem::ManuallyDrop::new(v);
                let (ptr, cap) = (v.as_mut_ptr(), v.capacity());
                row_unit.clear();
                // SAFETY: the same allocation, as `MaybeUninit<i64>` (the layout of `i64`),
                // with `len` elements of capacity `cap ≥ len` (the pool keys buffers by a
                // length they hold) that need no initialisation.
                let sums = unsafe { Vec::from_raw_parts(ptr.cast::<MaybeUninit<i64>>(), len, cap) };
                (sums, row_unit)
            }
            None => (unwritten_sums(len), Vec::new()),
        }
    }

    /// Keeps `v` and `row_unit` for a later [`SumsPool::take`] of `v`'s length, unless `v` is
    /// empty, too large or the pool is full (in bytes, or in sizes).
    fn give(&self, v: Vec<i64>, row_unit: Vec<i32>) {
        let bytes = v.len() * 8;
        if v.is_empty() || bytes > Self::LARGEST {
            return;
        }
        let Ok(mut free) = self.free.lock() else {
            return;
        };
        if free.bytes + bytes > Self::BYTES {
            return;
        }
        let at = match free.by_len.iter().position(|(l, _)| *l == v.len()) {
            Some(at) => at,
            None if free.by_len.len() < Self::SIZES => {
                free.by_len.push((v.len(), Vec::new()));
                free.by_len.len() - 1
            }
            None => return,
        };
        free.bytes += bytes;
        free.by_len[at].1.push((v, row_unit));
    }

    /// Bytes held.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.free.lock().map(|f| f.bytes).unwrap_or(0)
    }
}

/// `v` as an integer in units of `2^unit`, if it is one that fits an `i64` (and is not
/// [`WIDE`]).
fn in_units(v: &Exact, unit: i32) -> Option<i64> {
    match *v {
        Exact::Small { mant: 0, .. } => Some(0),
        Exact::Small { mant, exp } => {
            let shift = exp as i64 - unit as i64;
            if !(0..63).contains(&shift) {
                return None;
            }
            let s = (mant as i128) << shift;
            i64::try_from(s).ok().filter(|&s| s != WIDE)
        }
        Exact::Wide { .. } => None,
    }
}

/// Sums for `len` outputs, not yet written (see [`Sink::new`]).
pub(crate) fn unwritten_sums(len: usize) -> Vec<MaybeUninit<i64>> {
    let mut v = Vec::with_capacity(len);
    // SAFETY: `MaybeUninit` needs no initialisation, and the capacity is `len`.
    unsafe { v.set_len(len) };
    v
}

impl Accumulators {
    /// The accumulators a [`Sink`] wrote: `sums` in units of `row_unit` and `col_unit`.
    ///
    /// # Safety
    /// Every element of `sums` must be initialised (checked by [`Sink::all_slots_written`]).
    pub(crate) unsafe fn written(
        rows: usize,
        cols: usize,
        sums: Vec<MaybeUninit<i64>>,
        row_unit: Vec<i32>,
        col_unit: Arc<[i32]>,
        wide: Vec<(usize, Exact)>,
        recycle: Option<Arc<SumsPool>>,
    ) -> Accumulators {
        debug_assert_eq!(sums.len(), rows * cols);
        debug_assert!(row_unit.len() == rows && col_unit.len() >= cols);
        let mut sums = std::mem::ManuallyDrop::new(sums);
        let (ptr, len, cap) = (sums.as_mut_ptr(), sums.len(), sums.capacity());
        // SAFETY: same allocation, layout (`MaybeUninit<T>` has `T`'s) and length; every
        // element is initialised per the caller.
        let sums = unsafe { Vec::from_raw_parts(ptr as *mut i64, len, cap) };
        Accumulators {
            rows,
            cols,
            sums,
            row_unit,
            col_unit,
            wide,
            recycle,
        }
    }

    /// Accumulators holding `values` (row-major `rows × cols`), for tools and tests that build
    /// or cut them by hand. Each row's unit is its values' smallest exponent.
    pub fn from_values(rows: usize, cols: usize, values: &[Exact]) -> Accumulators {
        assert_eq!(values.len(), rows * cols, "one value per element");
        let row_unit: Vec<i32> = (0..rows)
            .map(|r| {
                values[r * cols..(r + 1) * cols]
                    .iter()
                    .filter_map(|v| match v {
                        Exact::Small { mant: 0, .. } => None,
                        Exact::Small { exp, .. } | Exact::Wide { exp, .. } => Some(*exp),
                    })
                    .min()
                    .unwrap_or(0)
            })
            .collect();
        let mut acc = Accumulators {
            rows,
            cols,
            sums: vec![0; rows * cols],
            row_unit,
            col_unit: vec![0; cols].into(),
            wide: Vec::new(),
            recycle: None,
        };
        for (i, v) in values.iter().enumerate() {
            acc.set(i / cols.max(1), i % cols.max(1), v.clone());
        }
        acc
    }

    /// The unit exponent of element `(row, col)`.
    fn unit(&self, row: usize, col: usize) -> i32 {
        self.row_unit[row] + self.col_unit[col]
    }

    /// The exact value of element `(row, col)`, in canonical form.
    pub fn get(&self, row: usize, col: usize) -> Exact {
        assert!(row < self.rows && col < self.cols, "element out of range");
        let i = row * self.cols + col;
        match self.sums[i] {
            WIDE => {
                let at = self
                    .wide
                    .binary_search_by_key(&i, |w| w.0)
                    .expect("every wide element has a wide value");
                self.wide[at].1.clone()
            }
            sum => Exact::from_i64(sum, self.unit(row, col)),
        }
    }

    /// Replaces the value of element `(row, col)` (a tool or test making a lie).
    pub fn set(&mut self, row: usize, col: usize, value: Exact) {
        assert!(row < self.rows && col < self.cols, "element out of range");
        let i = row * self.cols + col;
        let at = self.wide.binary_search_by_key(&i, |w| w.0);
        match (in_units(&value, self.unit(row, col)), at) {
            (Some(sum), Ok(at)) => {
                self.wide.remove(at);
                self.sums[i] = sum;
            }
            (Some(sum), Err(_)) => self.sums[i] = sum,
            (None, Ok(at)) => self.wide[at].1 = value,
            (None, Err(at)) => {
                self.wide.insert(at, (i, value));
                self.sums[i] = WIDE;
            }
        }
    }

    /// These accumulators cut into consecutive row groups of `rows[0]`, `rows[1]`, … rows (a
    /// product run over several hops' rows at once, handed back hop by hop). Each piece holds
    /// exactly the values of its rows.
    pub fn split_rows(&self, rows: &[usize]) -> Vec<Accumulators> {
        assert_eq!(
            rows.iter().sum::<usize>(),
            self.rows,
            "the groups cover every row"
        );
        let mut first = 0;
        rows.iter()
            .map(|&n| {
                let span = first * self.cols..(first + n) * self.cols;
                let wide = self
                    .wide
                    .iter()
                    .filter(|(i, _)| span.contains(i))
                    .map(|(i, v)| (i - span.start, v.clone()))
                    .collect();
                let piece = Accumulators {
                    rows: n,
                    cols: self.cols,
                    sums: self.sums[span].to_vec(),
                    row_unit: self.row_unit[first..first + n].to_vec(),
                    col_unit: self.col_unit.clone(),
                    wide,
                    recycle: self.recycle.clone(),
                };
                first += n;
                piece
            })
            .collect()
    }

    /// The elements kept whole because they do not fit an `i64` in their unit.
    pub fn wide_count(&self) -> usize {
        self.wide.len()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.sums.len() * 8 + self.row_unit.len() * 4 + self.wide.len() * 64
    }

    /// Row `row` as the kernels keep it: the row's unit exponent and each element's sum,
    /// column `c` being worth `sum · 2^(unit + col_units()[c])`, except that a sum of
    /// `i64::MIN` (never a fast kernel's) marks an element kept whole ([`Accumulators::get`]).
    pub fn row_as_kept(&self, row: usize) -> (i32, &[i64]) {
        assert!(row < self.rows, "row out of range");
        (
            self.row_unit[row],
            &self.sums[row * self.cols..(row + 1) * self.cols],
        )
    }

    /// Each column's unit exponent: for a kernel's accumulators, the smallest block exponent
    /// of the weights' column (what a checker holding the same weights computes itself).
    pub fn col_units(&self) -> &[i32] {
        &self.col_unit[..self.cols]
    }

    /// Row `row`'s elements as stored: each `Some((sum, unit))` (the value `sum · 2^unit`), or
    /// `None` for a wide one ([`Accumulators::get`] gives it).
    pub(crate) fn row_sums(&self, row: usize) -> impl Iterator<Item = Option<(i64, i32)>> + '_ {
        let (sums, ru) = (
            &self.sums[row * self.cols..(row + 1) * self.cols],
            self.row_unit[row],
        );
        sums.iter()
            .zip(self.col_unit.iter())
            .map(move |(&s, &cu)| (s != WIDE).then_some((s, ru + cu)))
    }
}

impl PartialEq for Accumulators {
    fn eq(&self, other: &Accumulators) -> bool {
        self.rows == other.rows
            && self.cols == other.cols
            && (0..self.rows).all(|r| (0..self.cols).all(|c| self.get(r, c) == other.get(r, c)))
    }
}

impl Eq for Accumulators {}

/// Shared write access to the outputs of one GEMM.
///
/// Kernels run on several threads; each output element belongs to exactly one task (tasks
/// split the columns by panel), so the raw writes never alias.
pub(crate) struct Sink {
    out: *mut f32,
    /// Where the exact accumulators go, in units of `row_unit[row] + col_unit[col]`.
    slots: Option<*mut i64>,
    row_unit: Vec<i32>,
    col_unit: Arc<[i32]>,
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

/// What a sink hands back besides the slots: each row's and column's unit, and the wide values.
pub(crate) type Units = (Vec<i32>, Arc<[i32]>, Vec<(usize, Exact)>);

/// Where a sink puts the exact accumulators ([`Sink::new`]).
pub(crate) struct SlotsOut<'a> {
    /// One per output, possibly uninitialised.
    pub(crate) sums: &'a mut [MaybeUninit<i64>],
    /// Per row of x, the smallest exponent of its blocks.
    pub(crate) row_unit: Vec<i32>,
    /// Per column of w (padded columns allowed), the smallest exponent of its blocks.
    pub(crate) col_unit: Arc<[i32]>,
}

/// A run of outputs a kernel stores itself (see [`Sink::run`]).
pub(crate) struct Run<'a> {
    /// The first f32 output of the run.
    pub(crate) out: *mut f32,
    /// The first slot of the run, when the exact accumulators are wanted (uninitialised
    /// memory: write only, then call [`Run::slots_written`]). A slot holds the output's `i64`
    /// sum in the unit the fast kernels add in (see [`Accumulators`]).
    pub(crate) slots: Option<*mut i64>,
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
    /// possibly uninitialised: the sink only writes them) with each row's and column's unit
    /// exponent (the smallest block exponent of the row of x and of the column of w).
    pub(crate) fn new(out: &mut [f32], cols: usize, slots: Option<SlotsOut<'_>>) -> Sink {
        let panels = cols.div_ceil(PANEL);
        let rows = out.len().checked_div(cols).unwrap_or(0);
        let (slots, row_unit, col_unit) = match slots {
            Some(SlotsOut {
                sums,
                row_unit,
                col_unit,
            }) => {
                assert_eq!(sums.len(), out.len(), "one slot per output");
                // (With no columns the rows cannot be told from the output.)
                assert!(
                    (cols == 0 || row_unit.len() == rows) && col_unit.len() >= cols,
                    "a unit per row and column"
                );
                (Some(sums.as_mut_ptr() as *mut i64), row_unit, col_unit)
            }
            None => (None, Vec::new(), Arc::from(Vec::new())),
        };
        let masks = if slots.is_some() { rows * panels } else { 0 };
        Sink {
            len: out.len(),
            out: out.as_mut_ptr(),
            slots,
            row_unit,
            col_unit,
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
        if self.slots.is_some() {
            if exp == self.row_unit[row] + self.col_unit[col] && sum != WIDE {
                self.put_slot(row, col, sum);
            } else {
                self.put_slot_of(row, col, Exact::from_i64(sum, exp));
            }
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
        if self.slots.is_some() {
            self.put_slot_of(row, col, value);
        }
        Ok(())
    }

    /// Stores `sum` (in the element's unit) as the slot of `(row, col)`.
    #[inline]
    fn put_slot(&self, row: usize, col: usize, sum: i64) {
        let idx = row * self.cols + col;
        assert!(idx < self.len, "sink index out of range");
        if let Some(slots) = self.slots {
            // SAFETY: idx < len, each index is written by exactly one task (a write: the slot
            // may be uninitialised).
            unsafe { slots.add(idx).write(sum) };
            self.mark(row, col, 1);
        }
    }

    /// Stores the exact `value` as the slot of `(row, col)`: in the element's unit when it
    /// fits, otherwise whole in the wide table.
    fn put_slot_of(&self, row: usize, col: usize, value: Exact) {
        let sum = in_units(&value, self.row_unit[row] + self.col_unit[col]).unwrap_or_else(|| {
            self.wide
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((row * self.cols + col, value));
            WIDE
        });
        self.put_slot(row, col, sum);
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

    /// The accumulators written: the units and the wide table (sorted by index).
    pub(crate) fn into_units(self) -> Units {
        let mut w = self.wide.into_inner().unwrap_or_else(|e| e.into_inner());
        w.sort_by_key(|e| e.0);
        (self.row_unit, self.col_unit, w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn units(rows: usize, unit: i32) -> (Vec<i32>, Arc<[i32]>) {
        (vec![unit; rows], vec![0; 2 * PANEL].into())
    }

    #[test]
    fn split_rows_gives_each_group_exactly_its_rows_values() {
        let (rows, cols) = (5, 3);
        let wide = Exact::Wide {
            neg: true,
            mag: vec![3, 1],
            exp: 4,
        };
        let values: Vec<Exact> = (0..rows * cols)
            .map(|i| match i {
                10 => wide.clone(),
                i => Exact::Small {
                    mant: 2 * i as i64 + 1,
                    exp: (i % 4) as i32 - 2,
                },
            })
            .collect();
        let acc = Accumulators::from_values(rows, cols, &values);
        assert_eq!(acc.wide_count(), 1);
        let pieces = acc.split_rows(&[2, 0, 3]);
        assert_eq!(pieces.iter().map(|p| p.rows).collect::<Vec<_>>(), [2, 0, 3]);
        let mut first = 0;
        for p in &pieces {
            for r in 0..p.rows {
                for c in 0..cols {
                    assert_eq!(p.get(r, c), values[(first + r) * cols + c], "({r}, {c})");
                }
            }
            first += p.rows;
        }
        assert_eq!(
            pieces[2].wide_count(),
            1,
            "the wide value goes with its row"
        );
    }

    #[test]
    fn slots_are_handed_out_only_when_every_one_was_written() {
        // 3 rows × 21 columns: a full panel and a partial one of 5 columns.
        let (rows, cols) = (3, 21);
        let mut out = vec![0f32; rows * cols];
        let mut sums = unwritten_sums(rows * cols);
        let (row_unit, col_unit) = units(rows, -2);
        let slots = SlotsOut {
            sums: &mut sums,
            row_unit,
            col_unit,
        };
        let sink = Sink::new(&mut out, cols, Some(slots));
        for r in 0..rows {
            let run = sink.run(r, 0, PANEL).expect("a full panel");
            for c in 0..PANEL {
                // SAFETY: the run's slots are ours and in range.
                unsafe { run.slots.expect("slots wanted").add(c).write(0) };
            }
            run.slots_written();
            assert!(sink.run(r, PANEL, PANEL).is_none(), "past the last column");
            for c in PANEL..cols {
                if (r, c) != (2, 20) {
                    sink.put_i64(r, c, 6, -2).expect("finite");
                }
            }
        }
        assert!(!sink.all_slots_written(), "slot (2, 20) is missing");
        // Writing one slot twice does not stand in for another.
        sink.put_i64(2, 19, 6, -2).expect("finite");
        assert!(!sink.all_slots_written());
        sink.put_exact(2, 20, Exact::from_i64(-3, 4))
            .expect("finite");
        assert!(sink.all_slots_written());
        // Not in the element's unit: an i64 sum of another exponent, and a value below the unit.
        sink.put_i64(1, 17, 5, 3).expect("finite");
        sink.put_exact(0, 16, Exact::from_i64(1, -3))
            .expect("finite");
        let (row_unit, col_unit, wide) = sink.into_units();
        // SAFETY: every slot was written (checked above).
        let acc =
            unsafe { Accumulators::written(rows, cols, sums, row_unit, col_unit, wide, None) };
        // 6 · 2^-2 = 3 · 2^-1, canonical.
        assert_eq!(acc.get(0, cols - 1), Exact::Small { mant: 3, exp: -1 });
        assert_eq!(acc.get(2, 20), Exact::Small { mant: -3, exp: 4 });
        assert_eq!(acc.get(1, 17), Exact::Small { mant: 5, exp: 3 });
        assert_eq!(acc.get(0, 16), Exact::Small { mant: 1, exp: -3 });
        assert_eq!(acc.get(1, 3), Exact::ZERO);
        assert_eq!(acc.wide_count(), 1, "2^-3 is below its unit 2^-2");
    }

    #[test]
    fn empty_products_have_all_their_slots() {
        for (rows, cols) in [(0, 5), (4, 0), (0, 0)] {
            let mut out = vec![0f32; rows * cols];
            let mut sums = unwritten_sums(rows * cols);
            let (row_unit, col_unit) = units(rows, 0);
            let slots = SlotsOut {
                sums: &mut sums,
                row_unit,
                col_unit,
            };
            let sink = Sink::new(&mut out, cols, Some(slots));
            assert!(sink.all_slots_written(), "{rows} × {cols}");
        }
    }

    #[test]
    fn values_set_by_hand_are_read_back_whatever_their_exponent() {
        let wide = Exact::from_i128(-((1i128 << 70) + 1), -5);
        let values = vec![
            Exact::from_i64(12, 3),
            Exact::ZERO,
            wide.clone(),
            Exact::from_i64(-7, -40),
            Exact::from_i64(i64::MAX, 0),
            Exact::from_i64(1, 30),
        ];
        let mut acc = Accumulators::from_values(2, 3, &values);
        for (i, v) in values.iter().enumerate() {
            assert_eq!(&acc.get(i / 3, i % 3), v, "element {i}");
        }
        // A wide value replaced by a small one, and a small one by a wide one.
        acc.set(0, 2, Exact::from_i64(3, 0));
        acc.set(1, 1, wide.clone());
        assert_eq!(acc.get(0, 2), Exact::from_i64(3, 0));
        assert_eq!(acc.get(1, 1), wide);
        let mut again = values.clone();
        again[2] = Exact::from_i64(3, 0);
        again[4] = wide;
        assert_eq!(acc, Accumulators::from_values(2, 3, &again));
        assert_ne!(acc, Accumulators::from_values(2, 3, &values));
    }

    #[test]
    fn a_row_as_kept_holds_its_values_and_marks_a_wide_one() {
        let values = vec![
            Exact::from_i64(12, 3),
            Exact::ZERO,
            Exact::from_i64(-7, -4),
            Exact::from_i128(-((1i128 << 70) + 1), -5),
            Exact::from_i64(5, 0),
            Exact::from_i64(1, 2),
        ];
        let acc = Accumulators::from_values(2, 3, &values);
        let (unit, sums) = acc.row_as_kept(0);
        for (c, &sum) in sums.iter().enumerate() {
            let exp = unit + acc.col_units()[c];
            assert_eq!(Exact::from_i64(sum, exp), values[c], "column {c}");
        }
        assert_eq!(acc.row_as_kept(1).1[0], WIDE, "a wide value has no sum");
    }

    #[test]
    fn a_dropped_products_sums_buffer_serves_the_next_product_of_its_size() {
        use crate::{Gemm, Kernel, PackedWeights, QuantizedRows, WeightLayout};
        let (m, k, n) = (2, 64, 48);
        let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
        let qx = QuantizedRows::quantize(&x, m, k, "x").expect("finite");
        let qw = PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w").expect("finite");
        let g = Gemm::new(Kernel::best(), 1).expect("engine");
        let mut y = vec![0f32; m * n];
        let first = g.matmul_exact(&qx, &qw, &mut y).expect("product");
        let (buffers, want) = (
            (first.sums.as_ptr(), first.row_unit.as_ptr()),
            first.clone(),
        );
        drop(first);
        let second = g.matmul_exact(&qx, &qw, &mut y).expect("product");
        let reused = (second.sums.as_ptr(), second.row_unit.as_ptr());
        assert_eq!(reused, buffers, "the dropped buffers were reused");
        assert_eq!(second, want);
        // Another engine has a pool of its own.
        let other = Gemm::new(Kernel::best(), 1).expect("engine");
        let third = other.matmul_exact(&qx, &qw, &mut y).expect("product");
        assert_ne!(third.sums.as_ptr(), buffers.0);
    }

    #[test]
    fn a_sums_pool_keeps_buffers_of_a_bounded_size_up_to_a_bounded_total() {
        let pool = SumsPool::default();
        pool.give(Vec::new(), Vec::new());
        pool.give(vec![0; SumsPool::LARGEST / 8 + 1], vec![0]);
        assert_eq!(
            pool.bytes(),
            0,
            "empty and oversized buffers go back to the allocator"
        );
        let len = SumsPool::LARGEST / 8;
        let mut kept = 0;
        for _ in 0..SumsPool::BYTES / SumsPool::LARGEST + 3 {
            pool.give(vec![7; len], vec![3]);
            kept = pool.bytes();
        }
        assert_eq!(kept, SumsPool::BYTES, "full at the bound, and no further");
        // Taken by length only: another length gets a fresh buffer.
        let (taken, row_unit) = pool.take(len);
        assert_eq!(
            (taken.len(), pool.bytes()),
            (len, SumsPool::BYTES - len * 8)
        );
        assert!(
            row_unit.is_empty() && row_unit.capacity() >= 1,
            "emptied, and reused"
        );
        assert_eq!(pool.take(len - 1).0.len(), len - 1);
        assert_eq!(pool.bytes(), SumsPool::BYTES - len * 8);
        // At most so many sizes.
        let pool = SumsPool::default();
        for len in 1..=SumsPool::SIZES + 5 {
            pool.give(vec![0; len], Vec::new());
        }
        let sizes = SumsPool::SIZES;
        assert_eq!(pool.bytes(), sizes * (sizes + 1) / 2 * 8);
    }
}
