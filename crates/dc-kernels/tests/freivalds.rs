//! Freivalds' check accepts every honest product and rejects any changed accumulator.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use dc_kernels::conformance::{matrix, Style};
use dc_kernels::rng::SplitMix64;
use dc_kernels::verify::freivalds::FreivaldsKey;
use dc_kernels::{Gemm, Kernel, PackedWeights, QuantizedRows, WeightLayout};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn honest_passes_and_any_change_fails(
        m in 1usize..6, k in 1usize..200, n in 1usize..40,
        span in 0i32..120, seed in any::<u64>(), which in any::<usize>(), delta in 1i64..1000,
    ) {
        let mut rng = SplitMix64::new(seed);
        let x = QuantizedRows::quantize(&matrix(&mut rng, m, k, Style::Span(span)), m, k, "x").unwrap();
        let w = PackedWeights::quantize(&matrix(&mut rng, n, k, Style::Normal), k, n, WeightLayout::NByK, "w").unwrap();
        let mut y = vec![0f32; m * n];
        let Ok(acc) = Gemm::new(Kernel::best(), 1).unwrap().matmul_exact(&x, &w, &mut y) else { return Ok(()) };
        let key = FreivaldsKey::new(&w, &[seed as u8; 32]);
        prop_assert_eq!(key.check(&x, &acc), Ok(()));
        // The row-by-row forms a spot check uses agree: exact values, and their residues.
        let row = which % m;
        let values: Vec<_> = (0..n).map(|j| acc.get(row, j)).collect();
        let residues: Vec<u64> = values.iter().map(dc_kernels::verify::freivalds::exact_mod).collect();
        prop_assert!(key.check_values(&x, row, &values));
        prop_assert!(key.check_residues(&x, row, &residues));
        // A row in units form (as a stage reveals it) enters the test as it travelled: the
        // same side as its residues', and it holds.
        let side = key.output_side_of_residues(&residues).unwrap();
        if let (Some(unit), sums) = dc_kernels::verify::reveal::row_for_reveal(&acc, row) {
            prop_assert_eq!(key.output_side_of_units(unit, &sums), Some(side));
            prop_assert!(key.holds(&x, row, side));
            prop_assert_eq!(key.output_side_of_units(unit, &sums[8..]), None);
            // Any sum changed by any amount: its side differs, and the test fails.
            let mut lie = sums.clone();
            let at = 8 * (which % n);
            let sum = i64::from_le_bytes(lie[at..at + 8].try_into().unwrap());
            lie[at..at + 8].copy_from_slice(&sum.wrapping_add(delta).to_le_bytes());
            let lied = key.output_side_of_units(unit, &lie).unwrap();
            prop_assert!(!key.holds(&x, row, lied));
            // As is the unit.
            let shifted = key.output_side_of_units(unit + 1, &sums).unwrap();
            prop_assert!(side == 0 || !key.holds(&x, row, shifted));
        }
        // Change one accumulator by any amount: caught.
        let mut bad = acc.clone();
        let i = which % (m * n);
        let (r, j) = (i / n, i % n);
        if let dc_kernels::Exact::Small { mant, exp } = acc.get(r, j) {
            let changed = mant.wrapping_add(delta * 2 + 1) | 1;
            bad.set(r, j, dc_kernels::Exact::Small { mant: changed, exp });
            if changed != mant {
                prop_assert_eq!(key.check(&x, &bad), Err(i / n));
                let mut lie: Vec<u64> =
                    (0..n).map(|c| dc_kernels::verify::freivalds::exact_mod(&acc.get(r, c))).collect();
                lie[j] = dc_kernels::verify::freivalds::exact_mod(&bad.get(r, j));
                prop_assert!(!key.check_residues(&x, r, &lie));
                prop_assert!(!key.check_residues(&x, r, &lie[1..]));
            }
        }
    }
}
