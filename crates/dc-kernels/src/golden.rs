//! The golden vectors of the numeric contract (`golden/golden_vectors_m7.json`, a copy of
//! `shared/numerics/`), cross-checked by an independent rational-arithmetic implementation.
//! Embedded in the binary so a volunteer's daemon checks them with no files around.

use serde_json::Value;

use crate::exact::Exact;
use crate::gemm::{reference, Gemm, Kernel};
use crate::pack::{PackedWeights, WeightLayout};
use crate::quant::{quantize_element_reference, QuantizedRows, BLOCK};

/// The golden vectors, as shipped.
pub const GOLDEN_JSON: &str = include_str!("../golden/golden_vectors_m7.json");

/// What a golden run checked and what failed.
#[derive(Clone, Debug, Default)]
pub struct GoldenReport {
    /// Vector sets run.
    pub sets: usize,
    /// Individual values compared.
    pub checks: usize,
    /// One line per difference.
    pub failures: Vec<String>,
}

impl GoldenReport {
    fn check<T: PartialEq + std::fmt::Debug>(
        &mut self,
        what: impl FnOnce() -> String,
        got: T,
        want: T,
    ) {
        self.checks += 1;
        if got != want {
            self.failures
                .push(format!("{}: got {got:?}, want {want:?}", what()));
        }
    }
}

fn f32s(v: &Value) -> Option<Vec<f32>> {
    v.as_array()?
        .iter()
        .map(|b| b.as_u64().map(|b| f32::from_bits(b as u32)))
        .collect()
}

fn ints(v: &Value) -> Option<Vec<i64>> {
    v.as_array()?.iter().map(Value::as_i64).collect()
}

/// The exact value as (decimal numerator, exponent), the golden file's form.
pub fn decimal_parts(e: &Exact) -> (String, i32) {
    match e {
        Exact::Small { mant, exp } => (mant.to_string(), *exp),
        Exact::Wide { neg, mag, exp } => {
            // Repeated division by 10^19 of the little-endian limbs.
            let mut limbs = mag.clone();
            let mut chunks = Vec::new();
            while limbs.iter().any(|&l| l != 0) {
                let mut rem: u128 = 0;
                for l in limbs.iter_mut().rev() {
                    let cur = (rem << 64) | *l as u128;
                    *l = (cur / 10_000_000_000_000_000_000) as u64;
                    rem = cur % 10_000_000_000_000_000_000;
                }
                chunks.push(rem as u64);
            }
            let mut s = String::new();
            if *neg {
                s.push('-');
            }
            for (i, c) in chunks.iter().rev().enumerate() {
                if i == 0 {
                    s.push_str(&c.to_string());
                } else {
                    s.push_str(&format!("{c:019}"));
                }
            }
            (s, *exp)
        }
    }
}

/// Runs every golden vector set against the quantiser, the reference kernel and each kernel
/// in `kernels`.
pub fn run(kernels: &[Kernel]) -> GoldenReport {
    let mut rep = GoldenReport::default();
    let doc: Value = match serde_json::from_str(GOLDEN_JSON) {
        Ok(v) => v,
        Err(e) => {
            rep.failures
                .push(format!("golden file does not parse: {e}"));
            return rep;
        }
    };
    let Some(sets) = doc.as_object() else {
        rep.failures.push("golden file is not an object".into());
        return rep;
    };
    for (name, set) in sets {
        if name == "format" {
            continue;
        }
        rep.sets += 1;
        let ok = if set.get("w_f32_bits_k_by_n").is_some() {
            dot_set(name, set, kernels, &mut rep)
        } else {
            quant_set(name, set, &mut rep)
        };
        if ok.is_none() {
            rep.failures.push(format!("{name}: malformed vector set"));
        }
    }
    rep
}

fn quant_set(name: &str, set: &Value, rep: &mut GoldenReport) -> Option<()> {
    let x = f32s(set.get("x_f32_bits")?)?;
    let q = set.get("q")?.as_array()?;
    let m = ints(set.get("m")?)?;
    let e = ints(set.get("e")?)?;
    let qr = QuantizedRows::quantize(&x, 1, x.len(), name).ok()?;
    for b in 0..qr.blocks() {
        let want_q = ints(q.get(b)?)?;
        let got: Vec<i64> = qr.block(0, b).iter().map(|&v| v as i64).collect();
        rep.check(|| format!("{name} block {b} q"), got, want_q.clone());
        let s = qr.scale(0, b);
        rep.check(|| format!("{name} block {b} m"), s.m as i64, *m.get(b)?);
        rep.check(|| format!("{name} block {b} e"), s.e as i64, *e.get(b)?);
        for t in 0..BLOCK {
            let xv = x.get(b * BLOCK + t).copied().unwrap_or(0.0);
            let r = quantize_element_reference(xv, s) as i64;
            rep.check(
                || format!("{name} block {b}[{t}] reference q"),
                r,
                want_q[t],
            );
        }
    }
    Some(())
}

fn dot_set(name: &str, set: &Value, kernels: &[Kernel], rep: &mut GoldenReport) -> Option<()> {
    let xrows: Vec<Vec<f32>> = set
        .get("x_f32_bits")?
        .as_array()?
        .iter()
        .map(f32s)
        .collect::<Option<_>>()?;
    let wrows: Vec<Vec<f32>> = set
        .get("w_f32_bits_k_by_n")?
        .as_array()?
        .iter()
        .map(f32s)
        .collect::<Option<_>>()?;
    let (m, k, n) = (xrows.len(), wrows.len(), wrows.first()?.len());
    let x: Vec<f32> = xrows.concat();
    let w: Vec<f32> = wrows.concat();
    let qx = QuantizedRows::quantize(&x, m, k, name).ok()?;
    let qw = PackedWeights::quantize(&w, k, n, WeightLayout::KByN, name).ok()?;
    for r in 0..m {
        for b in 0..qx.blocks() {
            let want = ints(set["x_q"].get(r)?.get(b)?)?;
            let got: Vec<i64> = qx.block(r, b).iter().map(|&v| v as i64).collect();
            rep.check(|| format!("{name} x[{r}] block {b} q"), got, want);
            let s = qx.scale(r, b);
            rep.check(
                || format!("{name} x[{r}] block {b} m"),
                s.m as i64,
                set["x_m"].get(r)?.get(b)?.as_i64()?,
            );
            rep.check(
                || format!("{name} x[{r}] block {b} e"),
                s.e as i64,
                set["x_e"].get(r)?.get(b)?.as_i64()?,
            );
        }
    }
    for c in 0..n {
        for b in 0..qw.blocks() {
            let want = ints(set["w_q_per_column"].get(c)?.get(b)?)?;
            let got: Vec<i64> = qw.column_block(c, b).iter().map(|&v| v as i64).collect();
            rep.check(|| format!("{name} w[:, {c}] block {b} q"), got, want);
            let s = qw.scale(c, b);
            rep.check(
                || format!("{name} w[:, {c}] block {b} m"),
                s.m as i64,
                set["w_m_per_column"].get(c)?.get(b)?.as_i64()?,
            );
            rep.check(
                || format!("{name} w[:, {c}] block {b} e"),
                s.e as i64,
                set["w_e_per_column"].get(c)?.get(b)?.as_i64()?,
            );
        }
    }
    let mut terms = Vec::new();
    for r in 0..m {
        for c in 0..n {
            reference::element_terms(&qx, r, &qw, c, &mut terms);
            let want_terms = set["block_terms_int_exp"].get(r)?.get(c)?.as_array()?;
            for (b, t) in terms.iter().enumerate() {
                let wt = want_terms.get(b)?;
                rep.check(
                    || format!("{name} [{r},{c}] block {b} term"),
                    (t.0, t.1 as i64),
                    (wt.get(0)?.as_i64()?, wt.get(1)?.as_i64()?),
                );
            }
            let exact = reference::exact_element(&qx, r, &qw, c);
            let want = &set["exact_dot"].get(r)?.get(c)?;
            let want = (
                want.get("numerator")?.as_str()?.to_string(),
                want.get("exponent")?.as_i64()? as i32,
            );
            rep.check(
                || format!("{name} [{r},{c}] exact dot"),
                decimal_parts(&exact),
                want,
            );
        }
    }
    let want_bits: Vec<Vec<i64>> = set["y_f32_bits"]
        .as_array()?
        .iter()
        .map(ints)
        .collect::<Option<_>>()?;
    for &kernel in kernels {
        for threads in [1, 2] {
            let g = Gemm::new(kernel, threads).ok()?;
            let mut y = vec![0f32; m * n];
            if let Err(e) = g.matmul(&qx, &qw, &mut y) {
                rep.failures.push(format!("{name} {kernel}×{threads}: {e}"));
                continue;
            }
            for r in 0..m {
                for c in 0..n {
                    rep.check(
                        || format!("{name} {kernel}×{threads} y[{r},{c}]"),
                        y[r * n + c].to_bits() as i64,
                        want_bits[r][c],
                    );
                }
            }
        }
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal_of_wide_values() {
        let e = Exact::Wide {
            neg: true,
            mag: vec![0, 1],
            exp: 3,
        };
        assert_eq!(decimal_parts(&e), ("-18446744073709551616".to_string(), 3));
    }
}
