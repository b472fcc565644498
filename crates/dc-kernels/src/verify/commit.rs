//! Commitments (NUMERICS.md §5): blake3 with one derived key per kind of thing, Merkle trees
//! whose leaves are a product's output rows (its exact accumulators rounded once to f32), so a
//! checker can verify one row of a product without the rest (the attention context and the
//! MLP's hidden rows as the next product takes them, quantised), and the canonical encoding in
//! which a stage reveals a row's exact accumulators for a check.
//!
//! Nothing else in the code base hashes ad hoc: every hash goes through [`Domain`].

use std::fmt;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::exact::Exact;
use crate::gemm::{Accumulators, Gemm};
use crate::quant::QuantizedRows;
use crate::verify::hash_many::Messages;

/// A 32-byte blake3 commitment.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default)]
pub struct Commitment(pub [u8; 32]);

impl Commitment {
    /// Lower-case hex.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses 64 hex digits.
    pub fn from_hex(s: &str) -> Option<Commitment> {
        if s.len() != 64 || !s.is_ascii() {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Commitment(out))
    }
}

impl fmt::Display for Commitment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Commitment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Commitment({}…)", &self.to_hex()[..12])
    }
}

/// The kinds of things DaisyChain hashes. Each has its own derived blake3 key, so a hash of one
/// kind can never be passed off as a hash of another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Domain {
    /// Retired with protocol 4: one row of a GEMM's exact accumulators in their canonical
    /// encoding (a Merkle leaf). Kept so its context is never reused.
    GemmRow,
    /// An inner node of a Merkle tree.
    MerkleNode,
    /// A whole GEMM: its shape and the Merkle root of its rows.
    Gemm,
    /// Activations crossing a stage boundary (canonical little-endian f32 bytes).
    Activations,
    /// The ordered list of a hop's GEMM commitments.
    HopGemms,
    /// A signed hop record.
    HopRecord,
    /// Retired with protocol 14: a model id over its configuration and weights as loaded.
    Model,
    /// Retired with protocol 14: a weight tensor as loaded (inside the old model id).
    Tensor,
    /// The source of a cached quantised model (file identity).
    CacheKey,
    /// A fraud proof.
    FraudProof,
    /// One position's row of a layer's KV cache (a Merkle leaf).
    KvRow,
    /// One output row of a product, its f32 values (a Merkle leaf; since protocol 5).
    ProductRow,
    /// One row of activations quantised as a product takes them: its blocks' scales and
    /// elements (a Merkle leaf; since protocol 6, the MLP's hidden row; since protocol 7,
    /// the attention context too).
    QuantizedRow,
    /// A link of a generation's chain of hop inputs at one stage (since protocol 9): the
    /// chain before a hop and the hop's input commitment.
    InputChain,
    /// A model's manifest (since protocol 14, the model id): its files and pieces.
    Manifest,
    /// One piece of a model's files as stored (a tensor's bytes, a header, a small file).
    Piece,
}

impl Domain {
    const ALL: [Domain; 16] = [
        Domain::GemmRow,
        Domain::MerkleNode,
        Domain::Gemm,
        Domain::Activations,
        Domain::HopGemms,
        Domain::HopRecord,
        Domain::Model,
        Domain::Tensor,
        Domain::CacheKey,
        Domain::FraudProof,
        Domain::KvRow,
        Domain::ProductRow,
        Domain::QuantizedRow,
        Domain::InputChain,
        Domain::Manifest,
        Domain::Piece,
    ];

    /// The blake3 `derive_key` context: globally unique, never to be changed once shipped.
    pub fn context(self) -> &'static str {
        match self {
            Domain::GemmRow => "DaisyChain 2026-11-29 gemm row leaf v1",
            Domain::MerkleNode => "DaisyChain 2026-11-29 merkle node v1",
            Domain::Gemm => "DaisyChain 2026-11-29 gemm v1",
            Domain::Activations => "DaisyChain 2026-11-29 activations v1",
            Domain::HopGemms => "DaisyChain 2026-11-29 hop gemm list v1",
            Domain::HopRecord => "DaisyChain 2026-11-29 hop record v1",
            Domain::Model => "DaisyChain 2026-11-29 model id v1",
            Domain::Tensor => "DaisyChain 2026-11-29 tensor v1",
            Domain::CacheKey => "DaisyChain 2026-11-29 quantised cache key v1",
            Domain::FraudProof => "DaisyChain 2026-11-29 fraud proof v1",
            Domain::KvRow => "DaisyChain 2026-11-30 kv cache row leaf v1",
            Domain::ProductRow => "DaisyChain 2026-12-02 product output row leaf v1",
            Domain::QuantizedRow => "DaisyChain 2026-12-02 quantised activation row leaf v1",
            Domain::InputChain => "DaisyChain 2026-12-03 generation input chain v1",
            Domain::Manifest => "DaisyChain 2026-12-07 model manifest v1",
            Domain::Piece => "DaisyChain 2026-12-07 model file piece v1",
        }
    }

    fn key(self) -> &'static [u8; 32] {
        static KEYS: OnceLock<[[u8; 32]; Domain::ALL.len()]> = OnceLock::new();
        let keys = KEYS.get_or_init(|| {
            Domain::ALL.map(|d| blake3::derive_key(d.context(), b"DaisyChain domain key"))
        });
        // `ALL` lists the domains in declaration order (tested), so the discriminant indexes it.
        &keys[self as usize]
    }

    /// A keyed hasher for this domain.
    pub fn hasher(self) -> blake3::Hasher {
        blake3::Hasher::new_keyed(self.key())
    }

    /// Hashes `bytes` in this domain.
    pub fn hash(self, bytes: &[u8]) -> Commitment {
        Commitment(*self.hasher().update(bytes).finalize().as_bytes())
    }

    /// Hashes several parts, each prefixed by its length so parts cannot be re-split.
    pub fn hash_parts(self, parts: &[&[u8]]) -> Commitment {
        let mut h = self.hasher();
        for p in parts {
            h.update(&(p.len() as u64).to_le_bytes());
            h.update(p);
        }
        Commitment(*h.finalize().as_bytes())
    }
}

/// Appends the canonical encoding of one exact value:
/// - `mant: i64 LE, exp: i32 LE` (12 bytes) when the odd mantissa fits in an i64 (zero is `0, 0`);
/// - otherwise `0i64, i32::MIN, exp: i32, sign: u8, limbs: u32, limbs × u64 LE` (magnitude).
pub fn encode_exact(value: &Exact, out: &mut Vec<u8>) {
    match value {
        Exact::Small { mant, exp } => out.extend_from_slice(&small_bytes(*mant, *exp)),
        Exact::Wide { neg, mag, exp } => {
            out.extend_from_slice(&0i64.to_le_bytes());
            out.extend_from_slice(&i32::MIN.to_le_bytes());
            out.extend_from_slice(&exp.to_le_bytes());
            out.push(*neg as u8);
            out.extend_from_slice(&(mag.len() as u32).to_le_bytes());
            for l in mag {
                out.extend_from_slice(&l.to_le_bytes());
            }
        }
    }
}

/// The 12-byte encoding of a small value: `mant: i64 LE, exp: i32 LE`.
#[inline]
fn small_bytes(mant: i64, exp: i32) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[..8].copy_from_slice(&mant.to_le_bytes());
    b[8..].copy_from_slice(&exp.to_le_bytes());
    b
}

/// Appends the canonical encodings of `values`, one after another (what [`encode_exact`] gives
/// value by value, with small values written 12 bytes at a time into reserved space).
pub fn encode_values(values: &[Exact], out: &mut Vec<u8>) {
    let mut c = 0;
    while c < values.len() {
        let rest = &values[c..];
        out.reserve(rest.len() * 12);
        let start = out.len();
        let dst = out.spare_capacity_mut().as_mut_ptr() as *mut [u8; 12];
        let mut n = 0;
        for v in rest {
            let Exact::Small { mant, exp } = v else {
                break;
            };
            // SAFETY: `n < rest.len()` and `rest.len() · 12` bytes were reserved past `start`.
            unsafe { dst.add(n).write_unaligned(small_bytes(*mant, *exp)) };
            n += 1;
        }
        // SAFETY: the `n · 12` bytes past `start` were written above.
        unsafe { out.set_len(start + n * 12) };
        c += n;
        if let Some(wide) = values.get(c) {
            encode_exact(wide, out);
            c += 1;
        }
    }
}

/// Appends the canonical encoding of one output row of a GEMM.
///
/// Small values are put in canonical form from their stored sums and written 12 bytes at a
/// time into reserved space (no per-value capacity check); a wide one goes through
/// [`encode_exact`]. The bytes are those of the plain definition, value by value
/// (property-tested against it).
pub fn encode_row(acc: &Accumulators, row: usize, out: &mut Vec<u8>) {
    let mut slots = acc.row_sums(row).enumerate().peekable();
    while slots.peek().is_some() {
        out.reserve(acc.cols * 12);
        let start = out.len();
        let dst = out.spare_capacity_mut().as_mut_ptr() as *mut [u8; 12];
        let mut n = 0;
        // Small values up to the next wide one (almost always the whole row).
        while let Some((_, Some((sum, unit)))) = slots.next_if(|(_, s)| s.is_some()) {
            let (mant, exp) = match sum {
                0 => (0, 0),
                s => (s >> s.trailing_zeros(), unit + s.trailing_zeros() as i32),
            };
            // SAFETY: at most `cols` values are written past `start`, and `cols · 12` bytes
            // were reserved there.
            unsafe { dst.add(n).write_unaligned(small_bytes(mant, exp)) };
            n += 1;
        }
        // SAFETY: the `n · 12` bytes past `start` were written above.
        unsafe { out.set_len(start + n * 12) };
        if let Some((c, None)) = slots.next() {
            encode_exact(&acc.get(row, c), out);
        }
    }
}

/// Feeds `values` to `h` as their little-endian f32 bytes.
fn update_f32(h: &mut blake3::Hasher, values: &[f32]) {
    h.update(&f32_le_bytes(values));
}

/// `values` as f32 LE bytes: borrowed where that is their layout in memory.
fn f32_le_bytes(values: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: an f32 is 4 bytes with no padding, and on a little-endian machine its bytes
        // in memory are its little-endian bytes; the slice covers exactly `values`.
        std::borrow::Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), values.len() * 4)
        })
    }
    #[cfg(not(target_endian = "little"))]
    std::borrow::Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect())
}

/// The commitment to activations whose first row is at position `start`, rows of `width`
/// values: `H_activations(start: u64 LE, width: u64 LE, the values as f32 LE)`.
pub fn activations_commitment(start: usize, width: usize, values: &[f32]) -> Commitment {
    hash_headed(Domain::Activations, [start as u64, width as u64], values)
}

/// `H_domain(head[0]: u64 LE, head[1]: u64 LE, values as f32 LE)`.
///
/// A message of two chunks or more is hashed from one contiguous copy: handed its 16-byte head
/// first, the `blake3` crate would compress the rest of the first chunk block by block and could
/// not hash the chunks side by side (what a checker's opened rows mostly are).
fn hash_headed(domain: Domain, head: [u64; 2], values: &[f32]) -> Commitment {
    thread_local! {
        static MESSAGE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let mut h = domain.hasher();
    if 16 + values.len() * 4 < 2 * 1024 {
        h.update(&head[0].to_le_bytes());
        h.update(&head[1].to_le_bytes());
        update_f32(&mut h, values);
        return Commitment(*h.finalize().as_bytes());
    }
    MESSAGE.with_borrow_mut(|m| {
        m.clear();
        m.extend_from_slice(&head[0].to_le_bytes());
        m.extend_from_slice(&head[1].to_le_bytes());
        m.extend_from_slice(&f32_le_bytes(values));
        Commitment(*h.update(m).finalize().as_bytes())
    })
}

/// The Merkle leaf of one output row of a product at absolute sequence `position`:
/// `H_product_row(position: u64 LE, columns: u64 LE, the row's values as f32 LE)`, the values
/// being the exact accumulators rounded once to f32 (NUMERICS.md §3, before any bias), bit for
/// bit what the product hands on. The leaf names the position, so the rows of one hop can be checked
/// against a recomputation over a longer sequence.
pub fn product_row_leaf(position: usize, values: &[f32]) -> Commitment {
    hash_headed(
        Domain::ProductRow,
        [position as u64, values.len() as u64],
        values,
    )
}

/// The Merkle leaf of one row of quantised activations at absolute sequence `position`, `k`
/// elements whose canonical bytes ([`QuantizedRows::encode_row`]) are `bytes`:
/// `H_quantized_row(position: u64 LE, k: u64 LE, bytes)`. What a product takes in, bit for
/// bit; the leaf names the position like a product row's.
pub fn quantized_row_leaf(position: usize, k: usize, bytes: &[u8]) -> Commitment {
    let mut h = Domain::QuantizedRow.hasher();
    h.update(&(position as u64).to_le_bytes());
    h.update(&(k as u64).to_le_bytes());
    Commitment(*h.update(bytes).finalize().as_bytes())
}

/// Leaves wanted, queued to be hashed together ([`crate::verify::hash_many`]: short rows hashed one
/// at a time leave BLAKE3's SIMD idle), in sets that are each committed as a product is
/// (`gemm_commitment(leaves, cols, root)`): a prefill's rows of one product, or everything a
/// decode step commits in a layer (its products' rows, its cache rows, its attention rows).
/// A set may instead be one message whose hash is its commitment (a layer's input
/// activations). Every leaf and commitment is bit for bit the one hashed alone (tested).
#[derive(Clone, Debug, Default)]
pub struct LeafBatch {
    messages: Messages,
    /// The sets' Merkle nodes and commitments, a level at a time (kept for its buffers).
    nodes: Messages,
    sets: Vec<Set>,
    /// Leaves added since the last set was closed.
    open: usize,
}

/// A closed set of a [`LeafBatch`].
#[derive(Clone, Copy, Debug)]
enum Set {
    /// Leaves committed as a product: the columns its commitment names and how many leaves.
    Leaves { cols: usize, rows: usize },
    /// One message, its hash the set's commitment.
    Message,
}

impl LeafBatch {
    /// Adds a leaf to the open set: the hash in `domain` of `parts`, concatenated.
    pub fn leaf(&mut self, domain: Domain, parts: &[&[u8]]) {
        self.messages.push(domain.key(), parts);
        self.open += 1;
    }

    /// Adds the leaf of one product output row ([`product_row_leaf`]) to the open set.
    pub fn product_row(&mut self, position: usize, values: &[f32]) {
        let bytes = f32_le_bytes(values);
        self.leaf(
            Domain::ProductRow,
            &[
                &(position as u64).to_le_bytes(),
                &(values.len() as u64).to_le_bytes(),
                &bytes,
            ],
        );
    }

    /// Queues, as a set of its own, the hash in `domain` of `parts`, concatenated
    /// ([`Domain::hash`] of them): its commitment, with no leaves. No set may be open.
    pub fn message(&mut self, domain: Domain, parts: &[&[u8]]) {
        assert_eq!(self.open, 0, "a message is queued between sets");
        self.messages.push(domain.key(), parts);
        self.sets.push(Set::Message);
    }

    /// Queues, as a set of its own, [`activations_commitment`] of these activations.
    pub fn activations(&mut self, start: usize, width: usize, values: &[f32]) {
        self.message(
            Domain::Activations,
            &[
                &(start as u64).to_le_bytes(),
                &(width as u64).to_le_bytes(),
                &f32_le_bytes(values),
            ],
        );
    }

    /// Queues, as a set of its own, one product output row's leaf: its commitment is
    /// [`product_row_leaf`] (a checker opening a few revealed rows hashes them together).
    pub fn product_row_message(&mut self, position: usize, values: &[f32]) {
        self.message(
            Domain::ProductRow,
            &[
                &(position as u64).to_le_bytes(),
                &(values.len() as u64).to_le_bytes(),
                &f32_le_bytes(values),
            ],
        );
    }

    /// Queues, as a set of its own, one quantised row's leaf from its canonical bytes: its
    /// commitment is [`quantized_row_leaf`].
    pub fn quantized_row_message(&mut self, position: usize, k: usize, bytes: &[u8]) {
        self.message(
            Domain::QuantizedRow,
            &[
                &(position as u64).to_le_bytes(),
                &(k as u64).to_le_bytes(),
                bytes,
            ],
        );
    }

    /// Closes the open set; its commitment names `cols`.
    pub fn end_set(&mut self, cols: usize) {
        self.sets.push(Set::Leaves {
            cols,
            rows: self.open,
        });
        self.open = 0;
    }

    /// Queues, as one set, the rows of the `(rows, cols)` output `out` (the first row at
    /// position `first`) from position `from` on: what a product's commitment covers.
    pub fn queue(&mut self, out: &[f32], (rows, cols): (usize, usize), first: usize, from: usize) {
        assert_eq!(out.len(), rows * cols, "an output of rows × cols values");
        let skip = from.saturating_sub(first).min(rows);
        for r in skip..rows {
            self.product_row(first + r, &out[r * cols..(r + 1) * cols]);
        }
        self.end_set(cols);
    }

    /// Queues, as one set, the leaves ([`quantized_row_leaf`]) of the rows of `x` (the first
    /// row at position `first`) from position `from` on; its commitment names `x.k()`.
    pub fn queue_quantized(&mut self, x: &QuantizedRows, first: usize, from: usize) {
        self.queue_quantized_rows(x, 0..x.rows(), first, from);
    }

    /// [`LeafBatch::queue_quantized`] of the rows `rows` of `x` alone, the first of them at
    /// position `first` (one hop's rows of a product run over several hops).
    pub fn queue_quantized_rows(
        &mut self,
        x: &QuantizedRows,
        rows: std::ops::Range<usize>,
        first: usize,
        from: usize,
    ) {
        let skip = from.saturating_sub(first).min(rows.len());
        let mut bytes = Vec::new();
        for r in skip..rows.len() {
            bytes.clear();
            x.encode_row(rows.start + r, &mut bytes);
            self.leaf(
                Domain::QuantizedRow,
                &[
                    &((first + r) as u64).to_le_bytes(),
                    &(x.k() as u64).to_le_bytes(),
                    &bytes,
                ],
            );
        }
        self.end_set(x.k());
    }

    /// The number of sets queued.
    pub fn len(&self) -> usize {
        self.sets.len()
    }

    /// Whether none is queued.
    pub fn is_empty(&self) -> bool {
        self.sets.is_empty() && self.open == 0
    }

    /// The number of messages queued (leaves and lone messages), over all sets.
    pub fn rows(&self) -> usize {
        self.messages.len()
    }

    /// Each set's commitment and leaves, in the order they were queued, hashed on the current
    /// rayon pool when `parallel` (the same bits). The sets' Merkle nodes and commitments are
    /// hashed together too, a tree level at a time. Leaves the batch empty, its buffers kept
    /// for the next. Panics if a set is still open.
    pub fn finish(&mut self, parallel: bool) -> Vec<(Commitment, Vec<Commitment>)> {
        let done = self.finish_sets(parallel);
        (0..done.commitments.len())
            .map(|i| (done.commitments[i], done.leaves_of(i).to_vec()))
            .collect()
    }

    /// [`LeafBatch::finish`] without a list per set: every leaf in one list.
    pub fn finish_sets(&mut self, parallel: bool) -> FinishedSets {
        assert_eq!(self.open, 0, "every set closed before the batch is hashed");
        let hashes = match parallel {
            true => self.messages.keyed_hashes_par(),
            false => self.messages.keyed_hashes(),
        };
        // Every message's hash in queue order: the leaves, with each lone message's hash
        // (its set's commitment) where it was queued.
        let leaves: Vec<Commitment> = hashes.into_iter().map(Commitment).collect();
        let mut commitments = Vec::with_capacity(self.sets.len());
        let mut ranges = Vec::with_capacity(self.sets.len());
        let mut products = Vec::new();
        let mut at = 0;
        for (i, &set) in self.sets.iter().enumerate() {
            match set {
                Set::Leaves { cols, rows } => {
                    products.push((i, cols));
                    commitments.push(Commitment::default());
                    ranges.push(at..at + rows);
                    at += rows;
                }
                Set::Message => {
                    commitments.push(leaves[at]);
                    ranges.push(at..at);
                    at += 1;
                }
            }
        }
        let sets: Vec<(usize, &[Commitment])> = products
            .iter()
            .map(|&(i, cols)| (cols, &leaves[ranges[i].clone()]))
            .collect();
        let product_commitments = commit_leaf_sets_with(&sets, &mut self.nodes);
        for (&(i, _), c) in products.iter().zip(product_commitments) {
            commitments[i] = c;
        }
        self.messages.clear();
        self.sets.clear();
        FinishedSets {
            commitments,
            leaves,
            ranges,
        }
    }
}

/// What [`LeafBatch::finish_sets`] gives: each set's commitment, in the order queued, and all
/// the leaves in one list.
#[derive(Clone, Debug, PartialEq)]
pub struct FinishedSets {
    /// Each set's commitment.
    pub commitments: Vec<Commitment>,
    leaves: Vec<Commitment>,
    /// Per set, where its leaves are in `leaves` (empty for a lone message).
    ranges: Vec<std::ops::Range<usize>>,
}

impl FinishedSets {
    /// The leaves of set `set`.
    pub fn leaves_of(&self, set: usize) -> &[Commitment] {
        &self.leaves[self.ranges[set].clone()]
    }
}

/// Committing to a product's f32 output on the engine that made it. These live here, not in
/// `gemm`, so the product knows nothing of hashing and imports run one way: commitments over
/// the product.
impl Gemm {
    /// The commitment to the rows of the `(rows, cols)` output `out` (the first row at position
    /// `first`) from position `from` on, hashing the rows on this engine's threads (a
    /// prefill commits many rows; the result does not depend on the thread count).
    pub fn commit_from(
        &self,
        out: &[f32],
        shape: (usize, usize),
        first: usize,
        from: usize,
    ) -> Commitment {
        self.commit_leaves_from(out, shape, first, from).0
    }

    /// [`Self::commit_from`] with the committed rows' leaves (a stage keeps them to open a row
    /// later without hashing it again).
    pub fn commit_leaves_from(
        &self,
        out: &[f32],
        shape: (usize, usize),
        first: usize,
        from: usize,
    ) -> (Commitment, Vec<Commitment>) {
        thread_local! {
            // Reused, so a prefill's product does not fault in a fresh buffer for its rows.
            static BATCH: std::cell::RefCell<LeafBatch> = Default::default();
        }
        BATCH.with_borrow_mut(|batch| {
            batch.queue(out, shape, first, from);
            let done = self.finish_leaves(batch, shape.0 > 1);
            (done.commitments[0], done.leaves_of(0).to_vec())
        })
    }

    /// [`LeafBatch::finish_sets`] on this engine's threads when it has several and `many` rows
    /// are queued (the bits do not depend on it). An engine has a pool exactly when it has more
    /// than one thread, and [`Gemm::install`] runs on that pool.
    pub fn finish_leaves(&self, batch: &mut LeafBatch, many: bool) -> FinishedSets {
        if many && self.threads() > 1 {
            self.install(|| batch.finish_sets(true))
        } else {
            batch.finish_sets(false)
        }
    }
}

/// [`commit_leaves`] of several sets of leaves at once, each given with its columns: their
/// Merkle trees a level at a time, each level's nodes (and then every set's commitment) hashed
/// side by side ([`Messages`]), with the same bits as one set at a time.
pub fn commit_leaf_sets(sets: &[(usize, &[Commitment])]) -> Vec<Commitment> {
    commit_leaf_sets_with(sets, &mut Messages::default())
}

/// [`commit_leaf_sets`] hashing in `level`'s buffers.
fn commit_leaf_sets_with(sets: &[(usize, &[Commitment])], level: &mut Messages) -> Vec<Commitment> {
    level.clear();
    if sets.iter().all(|(_, l)| l.len() == 1) {
        // A decode step's sets: one leaf each, its own root.
        for (cols, leaves) in sets {
            push_gemm(level, 1, *cols, &leaves[0]);
        }
        return level.keyed_hashes().into_iter().map(Commitment).collect();
    }
    /// A Merkle node to hash: its children's places among the values (leaves first).
    struct Node {
        left: usize,
        right: usize,
        height: usize,
    }
    /// The nodes of the tree over `leaves` (places among the values), each appended with its
    /// place `base + index`; returns the place of its root and its height.
    fn tree(leaves: std::ops::Range<usize>, base: usize, nodes: &mut Vec<Node>) -> (usize, usize) {
        if leaves.len() == 1 {
            return (leaves.start, 0);
        }
        let k = split(leaves.len());
        let (left, hl) = tree(leaves.start..leaves.start + k, base, nodes);
        let (right, hr) = tree(leaves.start + k..leaves.end, base, nodes);
        let height = 1 + hl.max(hr);
        nodes.push(Node {
            left,
            right,
            height,
        });
        (base + nodes.len() - 1, height)
    }
    let mut values: Vec<Commitment> = sets.iter().flat_map(|(_, l)| l.iter().copied()).collect();
    let base = values.len();
    let mut nodes = Vec::new();
    let mut at = 0;
    // Each set's root: a place among the values, or `None` for a set without leaves.
    let roots: Vec<Option<usize>> = sets
        .iter()
        .map(|(_, l)| {
            let first = at;
            at += l.len();
            (!l.is_empty()).then(|| tree(first..at, base, &mut nodes).0)
        })
        .collect();
    values.resize(base + nodes.len(), Commitment::default());
    let top = nodes.iter().map(|n| n.height).max().unwrap_or(0);
    for height in 1..=top {
        level.clear();
        let at: Vec<usize> = (0..nodes.len())
            .filter(|&n| nodes[n].height == height)
            .collect();
        for &n in &at {
            let (l, r) = (&values[nodes[n].left], &values[nodes[n].right]);
            level.push(Domain::MerkleNode.key(), &[&l.0, &r.0]);
        }
        for (&n, h) in at.iter().zip(level.keyed_hashes()) {
            values[base + n] = Commitment(h);
        }
    }
    level.clear();
    for ((cols, leaves), root) in sets.iter().zip(&roots) {
        // No leaves: the root is the hash of nothing (`merkle_root`).
        let root = root.map_or_else(|| Domain::MerkleNode.hash(&[]), |r| values[r]);
        push_gemm(level, leaves.len(), *cols, &root);
    }
    level.keyed_hashes().into_iter().map(Commitment).collect()
}

/// Queues [`gemm_commitment`]'s message in `level`.
fn push_gemm(level: &mut Messages, rows: usize, cols: usize, root: &Commitment) {
    level.push(
        Domain::Gemm.key(),
        &[
            &(rows as u64).to_le_bytes(),
            &(cols as u64).to_le_bytes(),
            &root.0,
        ],
    );
}

/// The commitment of a product with `cols` values per row from the leaves of its committed
/// rows.
pub fn commit_leaves(cols: usize, leaves: &[Commitment]) -> Commitment {
    gemm_commitment(leaves.len(), cols, &merkle_root(leaves))
}

/// Row `row` of `acc` rounded to f32 as the product's epilogue rounds it. A value past the f32
/// range (which no product hands on: the kernel refuses it) rounds to infinity here, so a leaf
/// made of it matches no honest one.
pub fn rounded_row(acc: &Accumulators, row: usize) -> Vec<f32> {
    (0..acc.cols)
        .map(|c| acc.get(row, c).to_f32().unwrap_or(f32::INFINITY))
        .collect()
}

/// Exact values rounded as [`rounded_row`] rounds them.
pub fn rounded_values(values: &[Exact]) -> Vec<f32> {
    values
        .iter()
        .map(|v| v.to_f32().unwrap_or(f32::INFINITY))
        .collect()
}

/// The leaf of row `row` of `acc`, whose rows are positions from 0.
pub fn row_leaf(acc: &Accumulators, row: usize) -> Commitment {
    row_leaf_at(acc, row, 0)
}

/// The leaf of row `row` of `acc`, whose rows are positions from `first`: the leaf of its
/// rounded values (what the kernel wrote for that row).
pub fn row_leaf_at(acc: &Accumulators, row: usize, first: usize) -> Commitment {
    product_row_leaf(first + row, &rounded_row(acc, row))
}

/// The commitment to a product whose exact accumulators are `acc` and whose rows are positions
/// `first..first + rows`.
pub fn commit_gemm_at(acc: &Accumulators, first: usize) -> Commitment {
    commit_gemm_from(acc, first, first)
}

/// The commitment to the rows at positions `from..` of a product whose exact accumulators are
/// `acc`, the first row being at `first`: what a hop that started at `from` committed,
/// recomputed from a longer run (an audit replays every earlier position to rebuild the
/// caches).
pub fn commit_gemm_from(acc: &Accumulators, first: usize, from: usize) -> Commitment {
    let skip = from.saturating_sub(first).min(acc.rows);
    let leaves: Vec<Commitment> = (skip..acc.rows)
        .map(|r| row_leaf_at(acc, r, first))
        .collect();
    commit_leaves(acc.cols, &leaves)
}

/// A row leaf from exact values computed outside a product kernel: the leaf of their
/// roundings, in the same format as [`product_row_leaf`].
pub fn exact_row_leaf(position: usize, values: &[Exact]) -> Commitment {
    product_row_leaf(position, &rounded_values(values))
}

/// Every row leaf of a product from its exact accumulators.
pub fn row_leaves(acc: &Accumulators) -> Vec<Commitment> {
    (0..acc.rows).map(|r| row_leaf(acc, r)).collect()
}

/// The commitment to a whole GEMM: its shape and the Merkle root of its rows.
pub fn commit_gemm(acc: &Accumulators) -> Commitment {
    gemm_commitment(acc.rows, acc.cols, &merkle_root(&row_leaves(acc)))
}

/// Builds the GEMM commitment from its shape and row root (what a row checker recomputes).
pub fn gemm_commitment(rows: usize, cols: usize, root: &Commitment) -> Commitment {
    let mut bytes = [0u8; 48];
    bytes[..8].copy_from_slice(&(rows as u64).to_le_bytes());
    bytes[8..16].copy_from_slice(&(cols as u64).to_le_bytes());
    bytes[16..].copy_from_slice(&root.0);
    Domain::Gemm.hash(&bytes)
}

fn node(l: &Commitment, r: &Commitment) -> Commitment {
    let mut bytes = [0u8; 64];
    bytes[..32].copy_from_slice(&l.0);
    bytes[32..].copy_from_slice(&r.0);
    Domain::MerkleNode.hash(&bytes)
}

/// Split point of RFC 6962 trees: the largest power of two below `n`.
fn split(n: usize) -> usize {
    debug_assert!(n >= 2);
    1 << (usize::BITS - 1 - (n - 1).leading_zeros())
}

/// The Merkle root of `leaves` (RFC 6962 shape; one leaf is its own root; none is the hash of
/// nothing).
pub fn merkle_root(leaves: &[Commitment]) -> Commitment {
    match leaves.len() {
        0 => Domain::MerkleNode.hash(&[]),
        1 => leaves[0],
        n => {
            let k = split(n);
            node(&merkle_root(&leaves[..k]), &merkle_root(&leaves[k..]))
        }
    }
}

/// The audit path of leaf `index`: sibling hashes from the leaf up.
pub fn merkle_proof(leaves: &[Commitment], index: usize) -> Vec<Commitment> {
    assert!(index < leaves.len(), "leaf index out of range");
    let mut path = Vec::new();
    let (mut lo, mut hi, mut i) = (0, leaves.len(), index);
    let mut stack = Vec::new();
    while hi - lo > 1 {
        let k = split(hi - lo);
        if i < k {
            stack.push(merkle_root(&leaves[lo + k..hi]));
            hi = lo + k;
        } else {
            stack.push(merkle_root(&leaves[lo..lo + k]));
            lo += k;
            i -= k;
        }
    }
    while let Some(s) = stack.pop() {
        path.push(s);
    }
    path
}

/// A Merkle tree of [`merkle_root`]'s shape with every node kept, so that the audit paths of
/// many leaves cost one hash per node in all (a reveal of a prefill hop's rows opens every row
/// of a product: [`merkle_proof`] leaf by leaf rehashes the whole tree for each).
#[derive(Clone, Debug)]
pub struct MerkleTree {
    /// Each node's hash and, for an inner node, its children's places; the root last.
    nodes: Vec<(Commitment, Option<(u32, u32)>)>,
    leaves: usize,
}

impl MerkleTree {
    /// The tree over `leaves`.
    pub fn new(leaves: &[Commitment]) -> MerkleTree {
        fn build(leaves: &[Commitment], nodes: &mut Vec<(Commitment, Option<(u32, u32)>)>) {
            if leaves.len() == 1 {
                nodes.push((leaves[0], None));
                return;
            }
            let k = split(leaves.len());
            build(&leaves[..k], nodes);
            let left = nodes.len() - 1;
            build(&leaves[k..], nodes);
            let right = nodes.len() - 1;
            let hash = node(&nodes[left].0, &nodes[right].0);
            nodes.push((hash, Some((left as u32, right as u32))));
        }
        let mut nodes = Vec::with_capacity(2 * leaves.len());
        if !leaves.is_empty() {
            build(leaves, &mut nodes);
        }
        MerkleTree {
            nodes,
            leaves: leaves.len(),
        }
    }

    /// The root ([`merkle_root`] of the leaves).
    pub fn root(&self) -> Commitment {
        self.nodes
            .last()
            .map_or_else(|| merkle_root(&[]), |&(hash, _)| hash)
    }

    /// The audit path of leaf `index` ([`merkle_proof`]).
    pub fn proof(&self, index: usize) -> Vec<Commitment> {
        assert!(index < self.leaves, "leaf index out of range");
        let mut path = Vec::new();
        let (mut at, mut len, mut i) = (self.nodes.len() - 1, self.leaves, index);
        while let (_, Some((left, right))) = self.nodes[at] {
            let k = split(len);
            // Down the side holding leaf `i`: the first `k` leaves, or the rest.
            let (next, sibling) = match i < k {
                true => {
                    len = k;
                    (left, right)
                }
                false => {
                    (i, len) = (i - k, len - k);
                    (right, left)
                }
            };
            path.push(self.nodes[sibling as usize].0);
            at = next as usize;
        }
        path.reverse();
        path
    }
}

/// Checks that `leaf` is leaf `index` of a tree of `count` leaves with root `root`.
pub fn verify_merkle(
    root: &Commitment,
    leaf: &Commitment,
    index: usize,
    count: usize,
    proof: &[Commitment],
) -> bool {
    if index >= count {
        return false;
    }
    // Walk down to learn the side at each level, then fold the proof from the leaf up.
    let mut sides = Vec::new();
    let (mut lo, mut hi, mut i) = (0usize, count, index);
    while hi - lo > 1 {
        let k = split(hi - lo);
        if i < k {
            sides.push(true);
            hi = lo + k;
        } else {
            sides.push(false);
            lo += k;
            i -= k;
        }
    }
    if sides.len() != proof.len() {
        return false;
    }
    let mut h = *leaf;
    for (left, sib) in sides.iter().rev().zip(proof) {
        h = if *left { node(&h, sib) } else { node(sib, &h) };
    }
    h == *root
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaves(n: usize) -> Vec<Commitment> {
        (0..n).map(|i| Domain::GemmRow.hash(&[i as u8])).collect()
    }

    #[test]
    fn a_kept_tree_gives_every_root_and_path_the_leaves_give() {
        for n in 0..70 {
            let l = leaves(n);
            let tree = MerkleTree::new(&l);
            assert_eq!(tree.root(), merkle_root(&l), "{n} leaves");
            for i in 0..n {
                assert_eq!(tree.proof(i), merkle_proof(&l, i), "{n} leaves, leaf {i}");
            }
        }
    }

    #[test]
    fn every_leaf_proves_and_wrong_ones_do_not() {
        for n in 1..20 {
            let l = leaves(n);
            let root = merkle_root(&l);
            for i in 0..n {
                let proof = merkle_proof(&l, i);
                assert!(verify_merkle(&root, &l[i], i, n, &proof), "n={n} i={i}");
                let other = Domain::GemmRow.hash(b"forged");
                assert!(!verify_merkle(&root, &other, i, n, &proof));
                if n > 1 {
                    assert!(!verify_merkle(&root, &l[i], (i + 1) % n, n, &proof));
                }
            }
        }
    }

    #[test]
    fn domains_are_listed_in_declaration_order() {
        for (i, d) in Domain::ALL.iter().enumerate() {
            assert_eq!(*d as usize, i, "{d:?}");
        }
    }

    #[test]
    fn domains_separate() {
        assert_ne!(Domain::GemmRow.hash(b"x"), Domain::Activations.hash(b"x"));
        assert_ne!(
            Domain::Model.hash_parts(&[b"ab", b"c"]),
            Domain::Model.hash_parts(&[b"a", b"bc"])
        );
        let c = Domain::Model.hash(b"x");
        assert_eq!(Commitment::from_hex(&c.to_hex()), Some(c));
    }

    #[test]
    fn headed_hashes_are_the_plain_definition_either_side_of_the_copy() {
        // 508 values and the 16-byte head are the first message of two chunks.
        for n in [0usize, 1, 255, 507, 508, 509, 1536, 4096] {
            let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.37 - 11.0).collect();
            let mut bytes = Vec::new();
            for head in [7u64, n as u64] {
                bytes.extend_from_slice(&head.to_le_bytes());
            }
            for v in &values {
                bytes.extend_from_slice(&v.to_le_bytes());
            }
            assert_eq!(
                product_row_leaf(7, &values),
                Domain::ProductRow.hash(&bytes),
                "{n}"
            );
            assert_eq!(
                activations_commitment(7, n, &values),
                Domain::Activations.hash(&bytes),
                "{n}"
            );
        }
    }

    #[test]
    fn a_quantised_row_leaf_hashes_position_length_and_bytes() {
        let x: Vec<f32> = (0..40).map(|i| i as f32 - 19.5).collect();
        let q = QuantizedRows::quantize(&x, 1, 40, "x").unwrap();
        let mut bytes = Vec::new();
        q.encode_row(0, &mut bytes);
        let message = [&9u64.to_le_bytes()[..], &40u64.to_le_bytes(), &bytes].concat();
        assert_eq!(
            quantized_row_leaf(9, 40, &bytes),
            Domain::QuantizedRow.hash(&message)
        );
        assert_ne!(
            quantized_row_leaf(9, 40, &bytes),
            quantized_row_leaf(10, 40, &bytes)
        );
    }

    #[test]
    fn positioned_leaves_match_exact_leaves() {
        let acc = Accumulators::from_values(
            2,
            2,
            &[
                Exact::from_i64(3, 1),
                Exact::ZERO,
                Exact::from_i64(-5, -9),
                Exact::from_i64(1, 0),
            ],
        );
        let row1 = [Exact::from_i64(-5, -9), Exact::from_i64(1, 0)];
        assert_eq!(row_leaf_at(&acc, 1, 40), exact_row_leaf(41, &row1));
        assert_ne!(row_leaf_at(&acc, 1, 40), exact_row_leaf(40, &row1));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

        /// Products queued in one batch get, row for row, the leaves [`product_row_leaf`]
        /// gives each row alone, and the commitment of exactly those leaves, whether the
        /// batch is hashed in the lanes, one row at a time (too few chunks) or on a pool.
        #[test]
        fn a_batch_of_products_has_each_rows_own_leaf(
            shapes in proptest::collection::vec((1usize..6, 1usize..1600, 0usize..90, 0usize..8), 1..9),
            parallel in proptest::bool::ANY,
        ) {
            let mut batch = LeafBatch::default();
            let mut want = Vec::new();
            for (i, &(rows, cols, first, skip)) in shapes.iter().enumerate() {
                let out: Vec<f32> = (0..rows * cols)
                    .map(|v| (v as f32 - 700.5) * (i as f32 + 0.25))
                    .collect();
                let from = first + skip;
                batch.queue(&out, (rows, cols), first, from);
                let leaves: Vec<Commitment> = (from.saturating_sub(first).min(rows)..rows)
                    .map(|r| product_row_leaf(first + r, &out[r * cols..(r + 1) * cols]))
                    .collect();
                want.push((commit_leaves(cols, &leaves), leaves));
            }
            // A lone message (as a stage queues its layer's input activations).
            let acts: Vec<f32> = (0..shapes.len() * 300).map(|v| v as f32 * 0.5 - 3.0).collect();
            batch.activations(shapes.len(), 300, &acts);
            let bytes: Vec<u8> = [(shapes.len() as u64).to_le_bytes(), 300u64.to_le_bytes()]
                .concat()
                .into_iter()
                .chain(acts.iter().flat_map(|v| v.to_le_bytes()))
                .collect();
            let want_acts = Domain::Activations.hash(&bytes);
            proptest::prop_assert_eq!(activations_commitment(shapes.len(), 300, &acts), want_acts);
            want.push((want_acts, Vec::new()));
            // Lone leaves (as a checker queues the rows it opens).
            let row: Vec<f32> = acts[..shapes.len() * 97].to_vec();
            batch.product_row_message(shapes.len() + 5, &row);
            want.push((product_row_leaf(shapes.len() + 5, &row), Vec::new()));
            let encoded: Vec<u8> = (0..shapes.len() as u8 * 41).collect();
            batch.quantized_row_message(7, 3 * shapes.len(), &encoded);
            want.push((quantized_row_leaf(7, 3 * shapes.len(), &encoded), Vec::new()));
            // A set of other leaves (as a stage queues its cache rows) between the products.
            let cache: Vec<u8> = (0..200u8).collect();
            for (pos, row) in cache.chunks(40).enumerate() {
                batch.leaf(Domain::KvRow, &[&(pos as u64).to_le_bytes(), row]);
            }
            batch.end_set(40);
            let leaves: Vec<Commitment> = cache
                .chunks(40)
                .enumerate()
                .map(|(pos, row)| {
                    let mut h = Domain::KvRow.hasher();
                    h.update(&(pos as u64).to_le_bytes());
                    h.update(row);
                    Commitment(*h.finalize().as_bytes())
                })
                .collect();
            want.push((commit_leaves(40, &leaves), leaves));
            // Quantised rows (as a stage queues its MLP's hidden rows), from their third row.
            let (rows, k) = (shapes.len(), 96 + 37 * shapes.len());
            let x: Vec<f32> = (0..rows * k).map(|v| (v as f32 * 0.61).sin() * 5.0).collect();
            let q = QuantizedRows::quantize(&x, rows, k, "hidden").unwrap();
            batch.queue_quantized(&q, 40, 42);
            let leaves: Vec<Commitment> = (2..rows)
                .map(|r| {
                    let mut bytes = Vec::new();
                    q.encode_row(r, &mut bytes);
                    quantized_row_leaf(40 + r, k, &bytes)
                })
                .collect();
            want.push((commit_leaves(k, &leaves), leaves));
            proptest::prop_assert_eq!(batch.len(), shapes.len() + 5);
            let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
            let got = pool.install(|| batch.finish(parallel));
            proptest::prop_assert_eq!(got, want);
            proptest::prop_assert!(batch.is_empty(), "finishing empties the batch");
        }

        /// Sets of any number of leaves (none, one, up to past a tree's fifth level) committed
        /// together give each set's [`commit_leaves`].
        #[test]
        fn sets_committed_together_commit_as_each_alone(
            sizes in proptest::collection::vec((0usize..70, 1usize..5000), 0..12),
            seed in proptest::num::u64::ANY,
        ) {
            let sets: Vec<(usize, Vec<Commitment>)> = sizes
                .iter()
                .enumerate()
                .map(|(i, &(n, cols))| {
                    let leaves = (0..n)
                        .map(|j| Domain::ProductRow.hash(&[seed.to_le_bytes(), (i * 100 + j).to_le_bytes()].concat()))
                        .collect();
                    (cols, leaves)
                })
                .collect();
            let refs: Vec<(usize, &[Commitment])> =
                sets.iter().map(|(c, l)| (*c, &l[..])).collect();
            let want: Vec<Commitment> = sets.iter().map(|(c, l)| commit_leaves(*c, l)).collect();
            proptest::prop_assert_eq!(commit_leaf_sets(&refs), want);
            // Sets of one leaf each (a decode step's) take a shorter path.
            let ones: Vec<(usize, &[Commitment])> = sets
                .iter()
                .filter(|(_, l)| !l.is_empty())
                .map(|(c, l)| (*c, &l[..1]))
                .collect();
            let want: Vec<Commitment> = ones.iter().map(|(c, l)| commit_leaves(*c, l)).collect();
            proptest::prop_assert_eq!(commit_leaf_sets(&ones), want);
        }
    }

    #[test]
    fn encoding_is_canonical() {
        let mut a = Vec::new();
        encode_exact(&Exact::from_i64(6, 0), &mut a);
        let mut b = Vec::new();
        encode_exact(&Exact::from_i128(3 << 1, 0), &mut b);
        assert_eq!(a, b);
        assert_eq!(a.len(), 12);
    }
}
