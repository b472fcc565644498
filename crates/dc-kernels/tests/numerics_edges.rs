//! Rounding, quantisation and error paths at their edges: every fast routine against its
//! exact reference, and bad input refused with errors that say where.

use dc_kernels::exact::{exact_sum, round_i64_fast, round_limbs, round_u64};
use dc_kernels::quant::{quantize_block, quantize_element_reference, BlockScale};
use dc_kernels::{Gemm, Kernel, KernelError, PackedWeights, QuantizedRows, WeightLayout};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    #[test]
    fn fast_rounding_equals_exact_rounding(sum in any::<i64>(), exp in -420i32..260, small in any::<bool>()) {
        let sum = if small { sum >> 40 } else { sum };
        let want = round_u64(sum < 0, sum.unsigned_abs(), exp);
        let fast = round_i64_fast(sum, exp);
        match want {
            Some(v) => prop_assert_eq!(fast.to_bits(), v.to_bits()),
            None => prop_assert!(fast.is_infinite()),
        }
        let limbs = round_limbs(sum < 0, &[sum.unsigned_abs()], exp);
        prop_assert_eq!(limbs.map(f32::to_bits), want.map(f32::to_bits));
    }

    #[test]
    fn fast_quantiser_equals_exact_quantiser(bits in proptest::collection::vec(any::<u32>(), 1..33)) {
        let vals: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).filter(|v| v.is_finite()).collect();
        prop_assume!(!vals.is_empty());
        let mut q = [0i8; 32];
        let s = quantize_block(&vals, &mut q);
        let amax = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
        prop_assert!((128..=255).contains(&s.m) || amax == 0.0);
        for (i, &v) in vals.iter().enumerate() {
            prop_assert_eq!(q[i], quantize_element_reference(v, s), "{:e} with {:?}", v, s);
            prop_assert!(q[i] != i8::MIN);
        }
    }

    #[test]
    fn exact_sum_is_order_independent(mut terms in proptest::collection::vec((any::<i64>().prop_map(|t| t >> 28), -300i32..300), 0..40)) {
        let a = exact_sum(&terms);
        terms.reverse();
        prop_assert_eq!(exact_sum(&terms), a);
    }
}

#[test]
fn scale_boundaries_and_subnormals() {
    // 127 · m · 2^e exactly: the boundary belongs to that scale.
    let s = BlockScale::for_amax(127.0 * 200.0 * 2f32.powi(-20));
    assert_eq!((s.m, s.e), (200, -20));
    // The smallest subnormal.
    let tiny = f32::from_bits(1);
    let s = BlockScale::for_amax(tiny);
    assert!(s.to_f64() >= tiny as f64 / 127.0);
    let want = (tiny as f64 / s.to_f64()).round_ties_even() as i8;
    assert_eq!(quantize_element_reference(tiny, s), want);
    assert!(want >= 64, "the amax element keeps at least 7 bits: {want}");
}

#[test]
fn non_finite_input_is_refused_with_its_position() {
    let mut x = vec![0.5f32; 3 * 40];
    x[2 * 40 + 33] = f32::NEG_INFINITY;
    match QuantizedRows::quantize(&x, 3, 40, "layer 7 input") {
        Err(KernelError::NonFinite {
            tensor, row, col, ..
        }) => {
            assert_eq!((tensor.as_str(), row, col), ("layer 7 input", 2, 33));
        }
        other => panic!("expected NonFinite, got {other:?}"),
    }
    let mut w = vec![0.1f32; 40 * 5];
    w[40 * 4 + 1] = f32::NAN;
    let err = PackedWeights::quantize(&w, 40, 5, WeightLayout::NByK, "wq").unwrap_err();
    assert!(
        matches!(err, KernelError::NonFinite { row: 4, col: 1, .. }),
        "{err}"
    );
}

#[test]
fn shape_mismatches_are_errors_not_panics() {
    let x = QuantizedRows::quantize(&[1.0; 64], 2, 32, "x").unwrap();
    let w = PackedWeights::quantize(&[1.0; 33 * 4], 33, 4, WeightLayout::NByK, "w").unwrap();
    for kernel in Kernel::supported() {
        let g = Gemm::new(kernel, 2).unwrap();
        let mut y = vec![0.0; 8];
        let err = g.matmul(&x, &w, &mut y).unwrap_err();
        assert!(err.to_string().contains("k = 32 but w has k = 33"), "{err}");
        let w = PackedWeights::quantize(&[1.0; 32 * 4], 32, 4, WeightLayout::NByK, "w").unwrap();
        let mut short = vec![0.0; 7];
        assert!(matches!(
            g.matmul(&x, &w, &mut short),
            Err(KernelError::Shape { .. })
        ));
    }
    assert!(QuantizedRows::quantize(&[1.0; 5], 2, 3, "x").is_err());
    assert!(PackedWeights::quantize(&[1.0; 5], 0, 5, WeightLayout::NByK, "w").is_err());
}

#[test]
fn overflow_is_an_error_naming_the_first_element() {
    let x = QuantizedRows::quantize(&[3e38f32; 64], 2, 32, "x").unwrap();
    let w = PackedWeights::quantize(&[3e38f32; 32 * 20], 32, 20, WeightLayout::NByK, "w").unwrap();
    for kernel in Kernel::supported() {
        for threads in [1, 2] {
            let mut y = vec![0.0; 40];
            let err = Gemm::new(kernel, threads)
                .unwrap()
                .matmul(&x, &w, &mut y)
                .unwrap_err();
            assert_eq!(
                err,
                KernelError::Overflow {
                    op: "gemm",
                    row: 0,
                    col: 0
                },
                "{kernel}"
            );
        }
    }
}

#[test]
fn bad_kernel_and_thread_settings_are_named() {
    assert!(Kernel::parse("avx9")
        .unwrap_err()
        .to_string()
        .contains("avx9"));
    assert_eq!(Kernel::parse("scalar").unwrap(), Kernel::Scalar);
    assert_eq!(Kernel::parse("auto").unwrap(), Kernel::best());
    assert!(Gemm::new(Kernel::Scalar, 0).is_err());
    if !Kernel::Avx512.is_supported() {
        assert_eq!(
            Kernel::parse("avx512").unwrap_err(),
            KernelError::Unsupported("avx512")
        );
    }
}
