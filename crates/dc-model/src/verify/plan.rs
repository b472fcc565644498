//! What a spot check of some drawn parts of a layer tests and needs revealed, and how the parts
//! are drawn: the per-part rate that meets the detection goal. Pure bookkeeping over
//! [`CheckSet`]s; it never touches a row.

use dc_types::{CheckSet, Point};

/// What a check needs revealed ([`rows_needed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Needs {
    /// The rows of these products (those the layer has).
    pub rows: CheckSet,
    /// Whether the context row carries its values (the output projection's input).
    pub context_values: bool,
    /// Whether the MLP's hidden row carries its values (the down projection's input).
    pub hidden_values: bool,
    /// Whether the activations entering the layer are needed (the first products' input, the
    /// residuals).
    pub input: bool,
    /// Whether the activations leaving it are (the output's check).
    pub next: bool,
}

impl Needs {
    /// Whether the revealed row of `point` carries its values (a weight product's always do;
    /// the context's and the hidden row's only when a check takes them as the next product's
    /// input).
    pub fn values(&self, point: Point) -> bool {
        match point {
            Point::KvCache => false,
            Point::Context => self.context_values,
            Point::Hidden => self.hidden_values,
            _ => true,
        }
    }
}

/// Every weight product a layer may have.
pub(super) const WEIGHT_PRODUCTS: CheckSet = CheckSet::of(&[
    Point::Q,
    Point::K,
    Point::V,
    Point::O,
    Point::Gate,
    Point::Up,
    Point::Fc,
    Point::Down,
]);

/// The MLP's first products: their rows commit only through the hidden row made of them.
pub(super) const MLP_FIRST: CheckSet = CheckSet::of(&[Point::Gate, Point::Up, Point::Fc]);

/// The key and value projections: their rows commit only through the cache row made of them.
pub(super) const KEY_VALUE: CheckSet = CheckSet::of(&[Point::K, Point::V]);

/// The parts a check of `checks` tests: the drawn ones, and with either of a pair whose rows
/// commit together both of them — k and v (as the cache row attention reads) and the SwiGLU
/// MLP's gate and up (as the hidden row `silu(gate) · up`). A check of one takes the other as
/// its source: were that source untested, a stage lying in it could reveal a made-up row of
/// the drawn one's partner that, with the true drawn row, still makes the committed row.
pub fn tested_parts(checks: CheckSet) -> CheckSet {
    [KEY_VALUE, CheckSet::of(&[Point::Gate, Point::Up])]
        .into_iter()
        .fold(checks, |tests, pair| {
            match checks.intersection(pair).is_empty() {
                true => tests,
                false => tests.union(pair),
            }
        })
}

/// What a check of `checks` needs revealed. A tested weight product needs its own row and the
/// rows its input is made from: q, k and v the layer's input; the output projection the
/// attention context (taken as committed unless the attention is recomputed); the MLP's first
/// products (both of a pair, [`tested_parts`]) the layer's input, the output projection and the
/// hidden row's opening (the row they make must be the committed one); the down projection the
/// committed hidden row, with its values, unless the first products are tested and make it.
/// k and v (both of the pair) need the layer's input and, unless the attention is recomputed
/// (which verifies the whole cache), the opening of the cache row they make. The attention
/// (either of its products: the scores commit through the context they make) needs q, the
/// cache rows (the row's own among them) and the context row's opening; the layer's output
/// needs its input, the output and down projections and the activations leaving it.
pub fn rows_needed(checks: CheckSet) -> Needs {
    use Point::*;
    let checks = tested_parts(checks);
    let first_tested = !checks.intersection(MLP_FIRST).is_empty();
    let mut rows = checks.intersection(WEIGHT_PRODUCTS);
    // The context is recomputed only when the attention is drawn (and opens the committed
    // row); otherwise, when the output projection is tested, its committed row (with values)
    // is its input. Likewise the hidden row for the down projection.
    let context_values = checks.contains(O) && !checks.attention();
    let hidden_values = checks.contains(Down) && !first_tested;
    if checks.attention() {
        rows = rows.with(Q);
    }
    if !checks.intersection(KEY_VALUE).is_empty() && !checks.attention() {
        rows = rows.with(KvCache);
    }
    if checks.attention() || context_values {
        rows = rows.with(Context);
    }
    if first_tested || checks.contains(Output) {
        rows = rows.with(O);
    }
    if first_tested || hidden_values {
        rows = rows.with(Hidden);
    }
    if checks.contains(Output) {
        rows = rows.with(Down);
    }
    let input = [Q, K, V, Output].iter().any(|&p| checks.contains(p)) || first_tested;
    Needs {
        rows,
        context_values,
        hidden_values,
        input,
        next: checks.contains(Output),
    }
}

/// The parts of a layer of `config` a spot check can test: each weight product, both attention
/// products and the output (see [`CheckSet`]).
pub fn check_parts(config: &crate::ModelConfig) -> Vec<Point> {
    use Point::*;
    let mlp: &[Point] = match config.arch == crate::config::Arch::Gpt2 {
        true => &[Fc, Down],
        false => &[Gate, Up, Down],
    };
    [&[Q, K, V, Scores, Context, O][..], mlp, &[Output]].concat()
}

/// The detection goal the default spot-check rate is set for (issue 5): a stage that corrupts
/// at least `GOAL_PERCENT` % of the GEMMs it runs in the decode hops of a `GOAL_TOKENS`-token
/// generation escapes every spot check with probability at most `GOAL_ESCAPE`.
pub const GOAL_PERCENT: usize = 1;
/// See [`GOAL_PERCENT`].
pub const GOAL_TOKENS: usize = 256;
/// See [`GOAL_PERCENT`].
pub const GOAL_ESCAPE: f64 = 1e-6;

/// The GEMMs of one layer of `config` in one decode hop: the parts of [`check_parts`] but the
/// output (which is glue, not a product).
pub fn gemms_per_layer(config: &crate::ModelConfig) -> usize {
    check_parts(config)
        .iter()
        .filter(|&&p| p != Point::Output)
        .count()
}

/// The per-part rate that meets the goal ([`GOAL_PERCENT`]) for a stage of `layers` layers of
/// `config`. The fewest lies that are the goal's share of the stage's
/// `GOAL_TOKENS · gemms_per_layer · layers` GEMMs are `N` (rounded up), and each corrupted GEMM
/// is drawn with probability `c` on its own coin, so the liar escapes with `(1 − c)^N`; the
/// rate is the least `c` with `(1 − c)^N ≤ GOAL_ESCAPE`, `1 − GOAL_ESCAPE^(1/N)`. A stage of
/// fewer layers runs fewer GEMMs, so its share is fewer lies and it takes a higher rate (0.44
/// for one Llama layer, 0.058 for ten, 0.018 for 32).
pub fn goal_rate(config: &crate::ModelConfig, layers: usize) -> f64 {
    let gemms = GOAL_TOKENS * gemms_per_layer(config) * layers;
    let lies = (gemms * GOAL_PERCENT).div_ceil(100).max(1);
    // 1 − e^(ln(escape) / N), without the cancellation of computing the power first.
    -(GOAL_ESCAPE.ln() / lies as f64).exp_m1()
}

/// The parts a check tests when each of `parts` is drawn independently with probability
/// `rate` (`unit` gives the draws, uniform in `[0, 1)`; a rate of 1 or more takes every part).
/// Drawing parts rather than whole layers is what makes the guarantee independent of how a
/// liar places its lies: each corrupted product is tested with probability `rate`, whether the
/// liar spreads its lies over many layers or packs them into a few (docs/VERIFICATION.md).
pub fn draw_checks(parts: &[Point], rate: f64, mut unit: impl FnMut() -> f64) -> CheckSet {
    parts
        .iter()
        .filter(|_| rate >= 1.0 || unit() < rate)
        .fold(CheckSet::EMPTY, |s, &p| s.with(p))
}
