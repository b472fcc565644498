//! Commitments (NUMERICS.md §5): blake3 with one derived key per kind of thing, the canonical
//! encoding of exact accumulators, and Merkle trees whose leaves are output rows, so a checker
//! can verify one row of a product without the rest.
//!
//! Nothing else in the code base hashes ad hoc: every hash goes through [`Domain`].

use std::fmt;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::exact::Exact;
use crate::gemm::{Accumulators, Slot};

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
    /// One output row of a GEMM (a Merkle leaf).
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
    /// A model: its configuration and weights as loaded.
    Model,
    /// A weight tensor as loaded (inside the model id).
    Tensor,
    /// The source of a cached quantised model (file identity).
    CacheKey,
    /// A fraud proof.
    FraudProof,
}

impl Domain {
    const ALL: [Domain; 10] = [
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
        }
    }

    fn key(self) -> &'static [u8; 32] {
        static KEYS: OnceLock<Vec<[u8; 32]>> = OnceLock::new();
        let keys = KEYS.get_or_init(|| {
            Domain::ALL
                .iter()
                .map(|d| blake3::derive_key(d.context(), b"DaisyChain domain key"))
                .collect()
        });
        let i = Domain::ALL
            .iter()
            .position(|d| *d == self)
            .expect("every domain is listed in ALL");
        &keys[i]
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
        Exact::Small { mant, exp } => {
            out.extend_from_slice(&mant.to_le_bytes());
            out.extend_from_slice(&exp.to_le_bytes());
        }
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

/// Appends the canonical encoding of one output row of a GEMM.
pub fn encode_row(acc: &Accumulators, row: usize, out: &mut Vec<u8>) {
    let slots = &acc.slots[row * acc.cols..(row + 1) * acc.cols];
    out.reserve(slots.len() * 12);
    for (c, s) in slots.iter().enumerate() {
        if *s == Slot::WIDE {
            encode_exact(&acc.get(row, c), out);
        } else {
            out.extend_from_slice(&s.mant.to_le_bytes());
            out.extend_from_slice(&s.exp.to_le_bytes());
        }
    }
}

/// The Merkle leaf of one GEMM output row: `H_row(row index, column count, encoding)`.
pub fn row_leaf(acc: &Accumulators, row: usize) -> Commitment {
    let mut bytes = Vec::with_capacity(16 + acc.cols * 12);
    bytes.extend_from_slice(&(row as u64).to_le_bytes());
    bytes.extend_from_slice(&(acc.cols as u64).to_le_bytes());
    encode_row(acc, row, &mut bytes);
    Domain::GemmRow.hash(&bytes)
}

/// The Merkle leaf of row `row` of a GEMM whose rows are absolute sequence positions starting
/// at `first`: the leaf names the position, so the rows of one hop can be checked against a
/// recomputation over a longer sequence.
pub fn row_leaf_at(acc: &Accumulators, row: usize, first: usize) -> Commitment {
    let mut bytes = Vec::with_capacity(16 + acc.cols * 12);
    bytes.extend_from_slice(&((first + row) as u64).to_le_bytes());
    bytes.extend_from_slice(&(acc.cols as u64).to_le_bytes());
    encode_row(acc, row, &mut bytes);
    Domain::GemmRow.hash(&bytes)
}

/// The commitment to a GEMM whose rows are positions `first..first + rows`.
pub fn commit_gemm_at(acc: &Accumulators, first: usize) -> Commitment {
    commit_gemm_from(acc, first, first)
}

/// The commitment to the rows at positions `from..` of a GEMM whose rows are positions
/// `first..first + rows`: what a hop that started at `from` committed, recomputed from a longer
/// run (an audit replays every earlier position to rebuild the caches).
pub fn commit_gemm_from(acc: &Accumulators, first: usize, from: usize) -> Commitment {
    let skip = from.saturating_sub(first).min(acc.rows);
    let leaves: Vec<Commitment> = (skip..acc.rows)
        .map(|r| row_leaf_at(acc, r, first))
        .collect();
    gemm_commitment(acc.rows - skip, acc.cols, &merkle_root(&leaves))
}

/// [`commit_gemm_from`] with the rows hashed in parallel on the current rayon pool; the leaves
/// keep their order, so the commitment is the same.
pub(crate) fn commit_gemm_from_par(acc: &Accumulators, first: usize, from: usize) -> Commitment {
    use rayon::prelude::*;
    let skip = from.saturating_sub(first).min(acc.rows);
    let leaves: Vec<Commitment> = (skip..acc.rows)
        .into_par_iter()
        .map(|r| row_leaf_at(acc, r, first))
        .collect();
    gemm_commitment(acc.rows - skip, acc.cols, &merkle_root(&leaves))
}

/// A row leaf from exact values computed outside a GEMM kernel (the attention products), in
/// the same format as [`row_leaf_at`].
pub fn exact_row_leaf(position: usize, values: &[Exact]) -> Commitment {
    let mut bytes = Vec::with_capacity(16 + values.len() * 12);
    bytes.extend_from_slice(&(position as u64).to_le_bytes());
    bytes.extend_from_slice(&(values.len() as u64).to_le_bytes());
    for v in values {
        encode_exact(v, &mut bytes);
    }
    Domain::GemmRow.hash(&bytes)
}

/// Every row leaf of a GEMM.
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
    fn positioned_leaves_match_exact_leaves() {
        let acc = Accumulators {
            rows: 2,
            cols: 2,
            slots: vec![
                Slot { mant: 3, exp: 1 },
                Slot::default(),
                Slot { mant: -5, exp: -9 },
                Slot { mant: 1, exp: 0 },
            ],
            wide: vec![],
        };
        let row1 = [Exact::from_i64(-5, -9), Exact::from_i64(1, 0)];
        assert_eq!(row_leaf_at(&acc, 1, 40), exact_row_leaf(41, &row1));
        assert_ne!(row_leaf_at(&acc, 1, 40), exact_row_leaf(40, &row1));
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
