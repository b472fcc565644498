//! What a stage commits to for one hop: a commitment to every exact product it ran (each GEMM's
//! output rows, or for a product whose output reaches nothing but one glue step, the row that
//! step makes of it) and to the activations entering every layer, in a fixed order, under one
//! Merkle root that goes into the signed hop record.
//!
//! The order is the computation's: for each layer, its input activations, then q, the rows its
//! KV cache gained (k and v commit through them), the attention context (the scores commit
//! through it), the output
//! projection, the MLP's hidden activations as the down projection takes them (quantised: the
//! MLP's first products commit through them) and the down projection; after the last layer,
//! the output activations. Two honest stages produce the same list bit for bit; the first
//! differing entry locates a lie to one product of one layer, or to one of the products and
//! the glue step that one entry covers.

use dc_kernels::verify::commit::merkle_root;
use dc_kernels::{Commitment, Domain};
use serde::{Deserialize, Serialize};

/// The point of the computation an entry commits to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Point {
    /// Activations entering the layer.
    Input,
    /// Query projection.
    Q,
    /// Key projection.
    K,
    /// Value projection.
    V,
    /// Attention scores `Q · Kᵀ` (a part a check draws; since protocol 6 no entry of its own:
    /// committed through the context).
    Scores,
    /// Attention context `P' · V`: since protocol 7 its rows are committed as the output
    /// projection takes them, quantised (one leaf per row over its blocks' scales and
    /// elements, as for `Hidden`); the scores commit through it.
    Context,
    /// Output projection.
    O,
    /// SwiGLU gate projection.
    Gate,
    /// SwiGLU up projection.
    Up,
    /// SwiGLU / GELU down projection.
    Down,
    /// GELU MLP first projection.
    Fc,
    /// Activations leaving the last layer of the hop.
    Output,
    /// The rows the layer's KV cache gained in the hop (quantised keys with RoPE applied and
    /// quantised values, as attention reads them). Last in the enum so earlier points keep
    /// their numbers (they are hashed); recorded between V and the scores.
    KvCache,
    /// The MLP's hidden activations as the down projection takes them: `silu(gate) · up` (or
    /// GPT-2's `gelu(fc)`) quantised, one leaf per row over its blocks' scales and elements.
    /// Since protocol 6 the MLP's first products commit only through it: their outputs reach
    /// nothing else, and it is a quarter of their f32 bytes (half of one at 8 bits). Recorded
    /// between the output projection and the down projection.
    Hidden,
}

impl Point {
    /// Whether the product's output rows are committed under an entry of their own. Since
    /// protocol 6 three kinds are not, their outputs reaching nothing but one glue step into a
    /// committed row: the key and value projections (through the cache row attention reads,
    /// `KvCache`), the attention scores (through the softmax into the context they make) and
    /// the MLP's first products (`Gate`, `Up`, `Fc`: through the hidden row the down
    /// projection takes). A spot check of one of a pair tests both, so no revealed row of them
    /// goes untested.
    pub fn output_committed(self) -> bool {
        !matches!(
            self,
            Point::K | Point::V | Point::Scores | Point::Gate | Point::Up | Point::Fc
        )
    }
}

/// The parts of one layer a spot check tests, as a set of [`Point`]s: each weight product
/// (`Q`, `K`, `V`, `O`, `Gate`, `Up`, `Fc`, `Down`), the attention (`Scores`, `Context`: the
/// row's attention recomputed on the revealed cache) and the glue that makes the layer's
/// output (`Output`). The head draws each part independently, so a check reveals and tests only
/// what its parts need (docs/VERIFICATION.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CheckSet(pub u16);

impl CheckSet {
    /// Nothing.
    pub const EMPTY: CheckSet = CheckSet(0);

    /// The set of `points`.
    pub const fn of(points: &[Point]) -> CheckSet {
        let mut set = CheckSet::EMPTY;
        let mut i = 0;
        while i < points.len() {
            set = set.with(points[i]);
            i += 1;
        }
        set
    }

    /// This set with `point` added.
    pub const fn with(self, point: Point) -> CheckSet {
        CheckSet(self.0 | 1 << point as u16)
    }

    /// Whether `point` is in the set.
    pub fn contains(self, point: Point) -> bool {
        self.0 & (1 << point as u16) != 0
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The union.
    pub fn union(self, other: CheckSet) -> CheckSet {
        CheckSet(self.0 | other.0)
    }

    /// The points in both sets.
    pub fn intersection(self, other: CheckSet) -> CheckSet {
        CheckSet(self.0 & other.0)
    }

    /// The points of this set not in `other`.
    pub fn difference(self, other: CheckSet) -> CheckSet {
        CheckSet(self.0 & !other.0)
    }

    /// Whether the row's attention is recomputed (`Scores` or `Context` is tested).
    pub fn attention(self) -> bool {
        self.contains(Point::Scores) || self.contains(Point::Context)
    }

    /// Number of parts.
    pub fn len(self) -> usize {
        self.0.count_ones() as usize
    }
}

/// One committed point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// The layer.
    pub layer: u32,
    /// Which point of the layer.
    pub point: Point,
    /// The commitment.
    pub commitment: Commitment,
}

/// The commitments of one hop, in computation order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HopTrace {
    /// Only positions from here on are committed (a hop commits its own rows; an audit that
    /// replays earlier positions commits only the audited ones).
    pub from: usize,
    /// The entries.
    pub entries: Vec<Entry>,
}

impl HopTrace {
    /// An empty trace committing positions `from..`.
    pub fn from_position(from: usize) -> HopTrace {
        HopTrace {
            from,
            entries: Vec::new(),
        }
    }

    /// Records a point.
    pub fn push(&mut self, layer: usize, point: Point, commitment: Commitment) {
        self.entries.push(Entry {
            layer: layer as u32,
            point,
            commitment,
        });
    }

    /// The root that goes into the hop record.
    pub fn root(&self) -> Commitment {
        let leaves: Vec<Commitment> = self
            .entries
            .iter()
            .map(|e| {
                let mut b = Vec::with_capacity(37);
                b.extend_from_slice(&e.layer.to_le_bytes());
                b.push(e.point as u8);
                b.extend_from_slice(&e.commitment.0);
                Domain::HopGemms.hash(&b)
            })
            .collect();
        let root = merkle_root(&leaves);
        let mut b = Vec::with_capacity(40);
        b.extend_from_slice(&(leaves.len() as u64).to_le_bytes());
        b.extend_from_slice(&root.0);
        Domain::HopGemms.hash(&b)
    }

    /// The commitment recorded for `(layer, point)`, if any. A well-formed trace lists its
    /// layers in order, so the layer's run is found by bisection (a check looks entries up by
    /// the dozen in traces of hundreds); anything else falls back to a scan, so an entry that
    /// is there is always found.
    pub fn get(&self, layer: u32, point: Point) -> Option<Commitment> {
        let matches = |e: &&Entry| e.layer == layer && e.point == point;
        let at = self.entries.partition_point(|e| e.layer < layer);
        self.entries[at..]
            .iter()
            .take_while(|e| e.layer == layer)
            .find(matches)
            .or_else(|| self.entries.iter().find(matches))
            .map(|e| e.commitment)
    }

    /// Whether the entries are exactly the points an honest stage records for `layers`.
    pub fn is_well_formed(&self, layers: crate::LayerRange) -> bool {
        // The count first, from the range alone: a range of billions of layers (a hostile
        // record's) must not make a list of billions of points.
        let count = (layers.len() as usize)
            .checked_mul(PER_LAYER.len())
            .and_then(|n| n.checked_add(1));
        count == Some(self.entries.len())
            && expected_points(layers)
                .iter()
                .zip(&self.entries)
                .all(|(&(l, p), e)| e.layer == l && e.point == p)
    }

    /// The first entry where `other` differs (by position in the list), if any.
    pub fn first_difference(&self, other: &HopTrace) -> Option<usize> {
        let n = self.entries.len().min(other.entries.len());
        (0..n)
            .find(|&i| self.entries[i] != other.entries[i])
            .or((self.entries.len() != other.entries.len()).then_some(n))
    }
}

/// The points an honest stage records for each layer, in order.
const PER_LAYER: [Point; 7] = [
    Point::Input,
    Point::Q,
    Point::KvCache,
    Point::Context,
    Point::O,
    Point::Hidden,
    Point::Down,
];

/// The points an honest stage records for `layers`, in order (the same for every
/// architecture since protocol 6: the MLP's first products commit through `Hidden`).
pub fn expected_points(layers: crate::LayerRange) -> Vec<(u32, Point)> {
    let mut v: Vec<(u32, Point)> = (layers.start..layers.end)
        .flat_map(|l| PER_LAYER.iter().map(move |&p| (l, p)))
        .collect();
    v.push((layers.end - 1, Point::Output));
    v
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report

    use super::*;

    /// A well-formed trace of `layers`, entry `i` committing to `[i; 32]`.
    fn trace(layers: crate::LayerRange) -> HopTrace {
        HopTrace {
            from: 0,
            entries: expected_points(layers)
                .into_iter()
                .enumerate()
                .map(|(i, (layer, point))| Entry {
                    layer,
                    point,
                    commitment: Commitment([i as u8; 32]),
                })
                .collect(),
        }
    }

    /// What `get` means: the first entry for `(layer, point)`.
    fn scan(t: &HopTrace, layer: u32, point: Point) -> Option<Commitment> {
        let e = t
            .entries
            .iter()
            .find(|e| e.layer == layer && e.point == point);
        e.map(|e| e.commitment)
    }

    #[test]
    fn well_formedness_is_judged_without_listing_a_hostile_range() {
        let layers = crate::LayerRange::new(3, 9).unwrap();
        let t = trace(layers);
        assert!(t.is_well_formed(layers));
        assert!(!t.is_well_formed(crate::LayerRange::new(3, 8).unwrap()));
        // Billions of layers: 30 billion points were listed before the lengths were compared
        // (a record signed by a hostile peer can name any range). Now the count decides first.
        let all = crate::LayerRange::new(0, u32::MAX).unwrap();
        assert!(!t.is_well_formed(all));
        assert!(!HopTrace::from_position(0).is_well_formed(all));
    }

    #[test]
    fn lookups_find_what_a_scan_finds() {
        let layers = crate::LayerRange::new(3, 9).unwrap();
        let mut t = trace(layers);
        let points = [
            Point::Input,
            Point::Q,
            Point::Down,
            Point::Output,
            Point::Fc,
        ];
        let check = |t: &HopTrace| {
            for layer in 0..12 {
                for p in points {
                    assert_eq!(t.get(layer, p), scan(t, layer, p), "{layer} {p:?}");
                }
            }
        };
        check(&t);
        assert!(t.get(3, Point::Input).is_some() && t.get(8, Point::Output).is_some());
        assert_eq!(t.get(9, Point::Input), None);
        // Out of order (ill-formed, refused on receipt, but looked up all the same): every
        // entry is still found.
        t.entries.reverse();
        t.entries.swap(0, 30);
        for e in &t.entries {
            assert_eq!(t.get(e.layer, e.point), scan(&t, e.layer, e.point));
        }
        check(&t);
    }
}
