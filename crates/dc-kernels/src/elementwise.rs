//! Deterministic elementwise maths (NUMERICS.md §4): norms, softmax, RoPE, activations.
//!
//! The rules that make these bit-identical everywhere:
//! - reductions accumulate in f64, sequentially in index order, then round to f32;
//! - transcendentals come from the `libm` crate (the same code on every platform), evaluated
//!   in f64 and rounded to f32; never `f32::exp` and friends from std;
//! - no fused multiply-add (Rust never contracts on its own; we never call `mul_add`);
//! - every formula below is written in the exact order it is evaluated.

/// RMSNorm: `y_i = (x_i · r) · w_i` with `r = f32(1 / sqrt(Σ x² / n + eps))`, the sum in f64.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), weight.len(), "rms_norm weight length");
    assert_eq!(x.len(), out.len(), "rms_norm output length");
    let mut ss = 0f64;
    for &v in x {
        let v = v as f64;
        ss += v * v;
    }
    let r = (1.0 / (ss / x.len() as f64 + eps as f64).sqrt()) as f32;
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = (v * r) * w;
    }
}

/// LayerNorm: mean and variance in f64 (two sequential passes), then
/// `y_i = ((x_i - mean) · r) · w_i + b_i` in f32 with `mean`, `r = 1 / sqrt(var + eps)` rounded
/// to f32.
pub fn layer_norm(x: &[f32], weight: &[f32], bias: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), weight.len(), "layer_norm weight length");
    assert_eq!(x.len(), bias.len(), "layer_norm bias length");
    assert_eq!(x.len(), out.len(), "layer_norm output length");
    let n = x.len() as f64;
    let mut sum = 0f64;
    for &v in x {
        sum += v as f64;
    }
    let mean = sum / n;
    let mut var = 0f64;
    for &v in x {
        let d = v as f64 - mean;
        var += d * d;
    }
    let r = (1.0 / (var / n + eps as f64).sqrt()) as f32;
    let mean = mean as f32;
    for (((o, &v), &w), &b) in out.iter_mut().zip(x).zip(weight).zip(bias) {
        *o = ((v - mean) * r) * w + b;
    }
}

/// Softmax in place. Entries equal to `-inf` are masked: they become exact zeros and do not
/// take part. `p_i = f32(exp(x_i - max) / Σ exp(x_j - max))`, exp and the sum in f64, the sum
/// sequential in index order (for attention: absolute key order). An all-masked row becomes
/// all zeros. This is the definition; [`softmax_with`] is the same function, faster.
pub fn softmax(x: &mut [f32]) {
    let Some(max) = softmax_max(x) else {
        x.fill(0.0);
        return;
    };
    let exps: Vec<f64> = x
        .iter()
        .map(|&v| match v == f32::NEG_INFINITY {
            true => 0.0,
            false => libm::exp(v as f64 - max),
        })
        .collect();
    softmax_finish(x, &exps);
}

/// The largest unmasked entry, in f64 (`None` if every entry is masked). A masked entry is
/// `-inf`, which never wins a `max` against another value, so no entry needs skipping; the
/// maximum is taken in eight lanes, which gives the serial fold's value: `max` picks one of
/// its arguments, whatever the order. (Of `0.0` and `-0.0` either may come out; both shift
/// every entry to the same `exp`.)
fn softmax_max(x: &[f32]) -> Option<f64> {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            *m = m.max(v);
        }
    }
    let max = lanes
        .into_iter()
        .chain(rest.iter().copied())
        .fold(f32::NEG_INFINITY, f32::max);
    (max != f32::NEG_INFINITY).then_some(max as f64)
}

/// The probabilities from the exps: their sum in index order, then one division per entry.
/// A masked entry's exp is `0.0`, so adding it leaves the sum's bits as skipping it would (the
/// sum is never `-0.0`: the largest entry's exp is 1), and dividing it gives the `0.0` the
/// definition sets; with no branch on the mask, the divisions run in vector lanes.
fn softmax_finish(x: &mut [f32], exps: &[f64]) {
    debug_assert!(exps
        .iter()
        .zip(x.iter())
        .all(|(&e, &v)| v != f32::NEG_INFINITY || e == 0.0));
    let sum = exps.iter().fold(0f64, |sum, &e| sum + e);
    divide_by(x, exps, sum);
}

/// `x_i = f32(e_i / sum)`: IEEE divisions and roundings, the same in any lanes, compiled for
/// AVX-512 and AVX2 too where the CPU has them (the baseline's vectors hold two f64s).
fn divide_by(x: &mut [f32], exps: &[f64], sum: f64) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was detected.
            return unsafe { divide_by_avx512(x, exps, sum) };
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected.
            return unsafe { divide_by_avx2(x, exps, sum) };
        }
    }
    divide_by_each(x, exps, sum)
}

/// [`divide_by`]'s loop, as the baseline compiles it (and inlined into the other forms).
#[inline(always)]
fn divide_by_each(x: &mut [f32], exps: &[f64], sum: f64) {
    for (v, &e) in x.iter_mut().zip(exps) {
        *v = (e / sum) as f32;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn divide_by_avx512(x: &mut [f32], exps: &[f64], sum: f64) {
    divide_by_each(x, exps, sum)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn divide_by_avx2(x: &mut [f32], exps: &[f64], sum: f64) {
    divide_by_each(x, exps, sum)
}

/// [`softmax`] with a caller's scratch buffer and the exps four at a time
/// ([`crate::exp::exp_shifted`]: `libm::exp`'s own operations, so the same bits).
pub fn softmax_with(x: &mut [f32], exps: &mut Vec<f64>) {
    let Some(max) = softmax_max(x) else {
        x.fill(0.0);
        return;
    };
    crate::exp::exp_shifted(x, max, exps);
    softmax_finish(x, exps);
}

/// `log Σ exp(x_i)` of a row in f64 (for perplexity and KL measurements, not for the model).
pub fn log_sum_exp(x: &[f32]) -> f64 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut sum = 0f64;
    for &v in x {
        sum += libm::exp(v as f64 - max);
    }
    max + libm::log(sum)
}

/// SiLU: `f32(x / (1 + exp(-x)))`, evaluated in f64.
#[inline]
pub fn silu(x: f32) -> f32 {
    let x = x as f64;
    (x / (1.0 + libm::exp(-x))) as f32
}

/// `a_i = silu(a_i) · b_i` for every `i` (SwiGLU's gate times up), the exps four at a time
/// ([`crate::exp::exp_into`]: `libm::exp`'s own operations, so [`silu`]'s bits).
pub fn silu_mul(a: &mut [f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "silu_mul lengths");
    let neg: Vec<f64> = a.iter().map(|&x| -(x as f64)).collect();
    let mut e = vec![0f64; a.len()];
    crate::exp::exp_into(&neg, &mut e);
    for ((x, &y), &e) in a.iter_mut().zip(b).zip(&e) {
        *x = ((*x as f64) / (1.0 + e)) as f32 * y;
    }
}

/// GELU, tanh form (GPT-2's `gelu_new`):
/// `f32(0.5 · x · (1 + tanh(sqrt(2/π) · (x + 0.044715 · x³))))`, evaluated in f64.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
    let x = x as f64;
    let inner = SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x));
    (0.5 * x * (1.0 + libm::tanh(inner))) as f32
}

/// Rotary position embedding tables, one row per absolute position, half-split layout
/// (Hugging Face `rotate_half`): `inv_freq_i = θ^(-2i/d)`, angle `= pos · inv_freq_i`, both and
/// their cosine and sine in f64 with libm, rounded to f32.
#[derive(Clone, Debug)]
pub struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Tables for `positions` positions of a rotary dimension `dim` (even) and base `theta`.
    pub fn new(dim: usize, theta: f64, positions: usize) -> RopeTable {
        assert!(
            dim.is_multiple_of(2) && dim > 0,
            "rotary dimension must be even"
        );
        let half = dim / 2;
        let inv: Vec<f64> = (0..half)
            .map(|i| 1.0 / libm::pow(theta, (2 * i) as f64 / dim as f64))
            .collect();
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for &f in &inv {
                let a = p as f64 * f;
                cos.push(libm::cos(a) as f32);
                sin.push(libm::sin(a) as f32);
            }
        }
        RopeTable { half, cos, sin }
    }

    /// Positions covered.
    pub fn positions(&self) -> usize {
        self.cos.len() / self.half
    }

    /// Rotates one head vector `x` (length `2 · half`) for absolute position `pos`:
    /// `x'_i = x_i·c_i − x_{i+h}·s_i`, `x'_{i+h} = x_{i+h}·c_i + x_i·s_i`, products rounded
    /// before the sum (no FMA).
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let h = self.half;
        assert_eq!(x.len(), 2 * h, "rope head length");
        let (c, s) = (
            &self.cos[pos * h..(pos + 1) * h],
            &self.sin[pos * h..(pos + 1) * h],
        );
        for i in 0..h {
            let (a, b) = (x[i], x[i + h]);
            x[i] = a * c[i] - b * s[i];
            x[i + h] = b * c[i] + a * s[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_masks_and_sums_to_one() {
        let mut x = [1.0, f32::NEG_INFINITY, 3.0, 2.0];
        softmax(&mut x);
        assert_eq!(x[1], 0.0);
        let s: f32 = x.iter().sum();
        assert!((s - 1.0).abs() < 1e-6);
        assert!(x[2] > x[3] && x[3] > x[0]);
        let mut all = [f32::NEG_INFINITY; 3];
        softmax(&mut all);
        assert_eq!(all, [0.0; 3]);
    }

    /// The definition, taking each `exp` twice as NUMERICS.md states it.
    fn softmax_definition(x: &mut [f32]) {
        let max = x
            .iter()
            .copied()
            .filter(|v| *v != f32::NEG_INFINITY)
            .fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            x.fill(0.0);
            return;
        }
        let max = max as f64;
        let sum: f64 = x
            .iter()
            .filter(|v| **v != f32::NEG_INFINITY)
            .fold(0.0, |s, &v| s + libm::exp(v as f64 - max));
        for v in x.iter_mut() {
            *v = if *v == f32::NEG_INFINITY {
                0.0
            } else {
                (libm::exp(*v as f64 - max) / sum) as f32
            };
        }
    }

    proptest::proptest! {
        #[test]
        fn both_softmaxes_are_the_definition(
            x in proptest::collection::vec(
                proptest::prop_oneof![
                    -100f32..100.0,
                    proptest::strategy::Just(f32::NEG_INFINITY),
                    -1e30f32..1e30,
                    proptest::strategy::Just(0.0f32),
                    proptest::strategy::Just(-0.0f32),
                ],
                0..300,
            )
        ) {
            let (mut kept, mut vector, mut slow) = (x.clone(), x.clone(), x);
            softmax(&mut kept);
            softmax_with(&mut vector, &mut Vec::new());
            softmax_definition(&mut slow);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            proptest::prop_assert_eq!(bits(&kept), bits(&slow));
            proptest::prop_assert_eq!(bits(&vector), bits(&slow));
        }
    }

    proptest::proptest! {
        #[test]
        fn every_form_of_divide_by_is_the_loop(
            exps in proptest::collection::vec(
                proptest::prop_oneof![0f64..1.0, proptest::strategy::Just(0.0), 1e-320f64..1e-300],
                0..70,
            ),
            sum in proptest::prop_oneof![1f64..1e4, proptest::strategy::Just(1.0)],
        ) {
            let want: Vec<u32> = exps.iter().map(|&e| ((e / sum) as f32).to_bits()).collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let mut x = vec![f32::NAN; exps.len()];
            divide_by_each(&mut x, &exps, sum);
            proptest::prop_assert_eq!(bits(&x), want.clone());
            #[cfg(target_arch = "x86_64")]
            {
                if is_x86_feature_detected!("avx512f") {
                    x.fill(f32::NAN);
                    // SAFETY: AVX-512F was detected.
                    unsafe { divide_by_avx512(&mut x, &exps, sum) };
                    proptest::prop_assert_eq!(bits(&x), want.clone());
                }
                if is_x86_feature_detected!("avx2") {
                    x.fill(f32::NAN);
                    // SAFETY: AVX2 was detected.
                    unsafe { divide_by_avx2(&mut x, &exps, sum) };
                    proptest::prop_assert_eq!(bits(&x), want);
                }
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn silu_mul_is_silu_times(a in proptest::collection::vec(
                                      proptest::prop_oneof![-30f32..30.0, -1e4f32..1e4, -1e-9f32..1e-9], 0..70),
                                  b in proptest::collection::vec(-3f32..3.0, 70)) {
            let b = &b[..a.len()];
            let mut fast = a.clone();
            silu_mul(&mut fast, b);
            let slow: Vec<f32> = a.iter().zip(b).map(|(&x, &y)| silu(x) * y).collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            proptest::prop_assert_eq!(bits(&fast), bits(&slow));
        }
    }

    #[test]
    fn activations_match_their_formulas() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(2.0) - 1.761_594_2).abs() < 1e-6);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
        assert_eq!(gelu_tanh(0.0), 0.0);
    }

    #[test]
    fn norms_match_their_formulas() {
        let x = [1.0f32, 2.0, 3.0, 4.0];
        let mut y = [0.0; 4];
        rms_norm(&x, &[1.0; 4], 0.0, &mut y);
        let r = (7.5f64).sqrt();
        for i in 0..4 {
            assert!((y[i] as f64 - x[i] as f64 / r).abs() < 1e-6);
        }
        layer_norm(&x, &[2.0; 4], &[1.0; 4], 0.0, &mut y);
        let sd = 1.25f64.sqrt();
        for i in 0..4 {
            let want = 2.0 * (x[i] as f64 - 2.5) / sd + 1.0;
            assert!((y[i] as f64 - want).abs() < 1e-5);
        }
    }

    #[test]
    fn rope_rotates_pairs() {
        let t = RopeTable::new(4, 10000.0, 8);
        let mut x = [1.0f32, 0.0, 0.0, 0.0];
        t.apply(&mut x, 0);
        assert_eq!(x, [1.0, 0.0, 0.0, 0.0]);
        let mut x = [1.0f32, 0.0, 0.0, 0.0];
        t.apply(&mut x, 1);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[2] - 1f32.sin()).abs() < 1e-6);
    }
}
