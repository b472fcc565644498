//! Every kernel equals the scalar reference bit for bit, at every thread count, whatever the
//! shape, magnitudes, exponent spans, zero blocks or ties (NUMERICS.md §6.1, §6.2).

use dc_kernels::commit::commit_gemm;
use dc_kernels::conformance::{matrix, Style};
use dc_kernels::rng::SplitMix64;
use dc_kernels::{Gemm, Kernel, PackedWeights, QuantizedRows, WeightLayout};
use proptest::prelude::*;

fn style() -> impl Strategy<Value = Style> {
    prop_oneof![
        Just(Style::Normal),
        (0i32..=250).prop_map(Style::Span),
        Just(Style::ZeroBlocks),
        Just(Style::Ties),
        Just(Style::Tiny),
        Just(Style::Huge),
    ]
}

fn run(
    g: &Gemm,
    x: &QuantizedRows,
    w: &PackedWeights,
) -> (
    Vec<u32>,
    Result<dc_kernels::Accumulators, dc_kernels::KernelError>,
) {
    let mut y = vec![0f32; x.rows() * w.n()];
    let acc = g.matmul_exact(x, w, &mut y);
    (y.iter().map(|v| v.to_bits()).collect(), acc)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn every_kernel_and_thread_count_equals_the_reference(
        m in prop_oneof![Just(1usize), 1usize..12],
        k in 1usize..320,
        n in 1usize..70,
        sx in style(),
        sw in style(),
        seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let x = matrix(&mut rng, m, k, sx);
        let w = matrix(&mut rng, n, k, sw);
        let qx = QuantizedRows::quantize(&x, m, k, "x").expect("finite");
        let qw = PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w").expect("finite");
        let reference = Gemm::new(Kernel::Scalar, 1).unwrap();
        let (want, want_acc) = run(&reference, &qx, &qw);
        for kernel in Kernel::supported() {
            for threads in [1, 2, 3] {
                let g = Gemm::new(kernel, threads).unwrap();
                let (got, got_acc) = run(&g, &qx, &qw);
                match (&want_acc, &got_acc) {
                    (Ok(a), Ok(b)) => {
                        prop_assert_eq!(&want, &got, "{} × {} threads", kernel, threads);
                        prop_assert_eq!(a, b);
                        prop_assert_eq!(commit_gemm(a), commit_gemm(b));
                    }
                    (Err(a), Err(b)) => prop_assert_eq!(a, b),
                    (a, b) => prop_assert!(false, "{kernel}: {b:?} vs reference {a:?}"),
                }
            }
        }
    }

    #[test]
    fn a_row_does_not_depend_on_the_rest_of_the_batch(
        m in 2usize..14,
        k in 1usize..200,
        n in 1usize..40,
        sx in style(),
        seed in any::<u64>(),
    ) {
        let mut rng = SplitMix64::new(seed);
        let x = matrix(&mut rng, m, k, sx);
        let w = matrix(&mut rng, n, k, Style::Normal);
        let qw = PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w").unwrap();
        let qx = QuantizedRows::quantize(&x, m, k, "x").unwrap();
        for kernel in Kernel::supported() {
            let g = Gemm::new(kernel, 2).unwrap();
            let (all, all_acc) = run(&g, &qx, &qw);
            if all_acc.is_err() {
                continue;
            }
            for r in 0..m {
                let one = QuantizedRows::quantize(&x[r * k..(r + 1) * k], 1, k, "x").unwrap();
                let (alone, _) = run(&g, &one, &qw);
                prop_assert_eq!(&all[r * n..(r + 1) * n], &alone[..], "{} row {}", kernel, r);
            }
        }
    }
}

#[test]
fn large_products_agree_across_kernels_and_threads() {
    // Big enough for several row chunks, full tiles and every panel split.
    let (m, k, n) = (37, 1000, 131);
    let mut rng = SplitMix64::new(7);
    let x = matrix(&mut rng, m, k, Style::Span(20));
    let w = matrix(&mut rng, n, k, Style::Normal);
    let qx = QuantizedRows::quantize(&x, m, k, "x").unwrap();
    let qw = PackedWeights::quantize(&w, k, n, WeightLayout::NByK, "w").unwrap();
    let (want, want_acc) = run(&Gemm::new(Kernel::Scalar, 1).unwrap(), &qx, &qw);
    let want_acc = want_acc.unwrap();
    for kernel in Kernel::supported() {
        for threads in [1, 2, 4] {
            let (got, acc) = run(&Gemm::new(kernel, threads).unwrap(), &qx, &qw);
            assert_eq!(want, got, "{kernel} × {threads}");
            assert_eq!(want_acc, acc.unwrap(), "{kernel} × {threads}");
        }
    }
}
